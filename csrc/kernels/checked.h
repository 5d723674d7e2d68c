// Copyright keras_rec_emb authors. Apache-2.0.
// A request too large for the memory left fails alone: the exceptions of a
// kernel's work (std::bad_alloc above all) become its status. An exception
// must not leave a kernel: thrown on a pool thread it ends the process
// (std::terminate); thrown on the caller's thread, where TensorFlow runs
// an eager op and small work runs inline, it crosses TensorFlow's C API
// into its Python bindings, which fault (SIGSEGV). Also how the kernels
// split their work over the intra-op pool (WorthSplitting, ShareOverPool).
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

// Whether n units of cost_per_unit cycles each are worth splitting over the
// intra-op pool: it has 2+ threads and the work reaches what TensorFlow's
// Shard gives a task of its own (tsl's kMinCostPerShard).
inline bool WorthSplitting(::tensorflow::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit) {
  constexpr int64_t kMinCostPerTask = 10000;
  return ctx->device()->tensorflow_cpu_worker_threads()->num_threads > 1 && n > 1 &&
         n * std::max<int64_t>(cost_per_unit, 1) >= kMinCostPerTask;
}

// Runs item(i) for i in [0, n) on the calling thread and num_threads - 1
// intra-op pool threads, each taking the next i (ShareWork). Not Shard's
// fixed blocks: with a few dozen units (a group's tables) on two threads, a
// block of several left one thread working alone for about a tenth of the op.
template <typename Fn>
void ShareOverPool(::tensorflow::OpKernelContext* ctx, int64_t n, Fn&& item) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  ShareWork(
      workers->num_threads - 1,
      [&](std::function<void()> task) { workers->workers->Schedule(std::move(task)); }, n, item);
}

// Runs fn(begin, end) over ranges of [0, n): one range on this thread when
// not WorthSplitting, else up to `ranges_per_thread` ranges a thread over
// the pool (ShareOverPool; many small ranges even out units of unequal
// cost, a few large ones suit work that reads its input best in long
// runs). An exception of fn becomes ResourceExhausted (the request's
// scratch did not fit) and the other ranges still run.
template <typename Fn>
absl::Status ShardChecked(::tensorflow::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit,
                          Fn&& fn, int64_t ranges_per_thread = 16) {
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
  if (n <= 0) return status;
  if (!WorthSplitting(ctx, n, cost_per_unit)) {
    range(0, n);
    return status;
  }
  const int64_t threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
  const int64_t ranges = std::min<int64_t>(n, std::max<int64_t>(1, ranges_per_thread) * threads);
  ShareOverPool(ctx, ranges, [&](int64_t r) { range(n * r / ranges, n * (r + 1) / ranges); });
  return status;
}

}  // namespace kre

#endif  // KRE_KERNELS_CHECKED_H_
