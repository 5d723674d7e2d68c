// Copyright keras_rec_emb authors. Apache-2.0.
// A request too large for the memory left fails alone: the exceptions of a
// kernel's work (std::bad_alloc above all) become its status. An exception
// must not leave a kernel: thrown on a pool thread it ends the process
// (std::terminate); thrown on the caller's thread, where TensorFlow runs
// an eager op and Shard runs small work, it crosses TensorFlow's C API
// into its Python bindings, which fault (SIGSEGV).
#ifndef KRE_KERNELS_CHECKED_H_
#define KRE_KERNELS_CHECKED_H_

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <utility>

#include "core/share_work.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kre {

inline absl::Status TooLarge() {
  return ::tensorflow::errors::ResourceExhausted(
      "out of memory for the op's scratch: the request is too large for the memory left");
}

// Runs a kernel's Compute body. Besides the kernel's own scratch,
// allocate_output and allocate_temp may throw std::bad_alloc rather than
// fail: TensorFlow's BFC allocator grows its region bookkeeping (a
// std::vector) unchecked when it maps a new region.
template <typename Body>
void ComputeChecked(::tensorflow::OpKernelContext* ctx, Body&& body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    ctx->SetStatus(TooLarge());
  } catch (const std::exception& e) {
    ctx->SetStatus(::tensorflow::errors::ResourceExhausted("a request's work failed: ", e.what()));
  }
}

// Runs fn(begin, end) over ranges of [0, n) on the intra-op pool: inline
// when the pool has one thread or the work is below what TensorFlow's Shard
// gives a task of its own, else in up to 16 ranges a thread, taken one at a
// time by the calling thread and num_threads - 1 pool threads (ShareWork;
// Shard's fixed blocks left one thread working alone at the end). An
// exception of fn becomes ResourceExhausted (the request's scratch did not
// fit) and the other ranges still run.
template <typename Fn>
absl::Status ShardChecked(::tensorflow::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit,
                          Fn&& fn) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  std::mutex mu;
  absl::Status status;
  auto range = [&](int64_t begin, int64_t end) {
    try {
      fn(begin, end);
    } catch (const std::bad_alloc&) {
      std::lock_guard<std::mutex> lock(mu);
      status = TooLarge();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      status = ::tensorflow::errors::ResourceExhausted("a request's work failed: ", e.what());
    }
  };
  constexpr int64_t kMinCostPerTask = 10000;  // tsl's Shard: kMinCostPerShard
  const int64_t threads = workers->num_threads;
  if (n <= 0) return status;
  if (threads <= 1 || n == 1 || n * std::max<int64_t>(cost_per_unit, 1) < kMinCostPerTask) {
    range(0, n);
    return status;
  }
  const int64_t ranges = std::min<int64_t>(n, 16 * threads);
  ShareWork(
      threads - 1, [&](std::function<void()> task) { workers->workers->Schedule(std::move(task)); },
      ranges, [&](int64_t r) { range(n * r / ranges, n * (r + 1) / ranges); });
  return status;
}

}  // namespace kre

#endif  // KRE_KERNELS_CHECKED_H_
