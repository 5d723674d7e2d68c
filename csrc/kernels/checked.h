// Copyright keras_rec_emb authors. Apache-2.0.
// A request too large for the memory left fails alone: the exceptions of a
// kernel's work (std::bad_alloc above all) become its status. An exception
// must not leave a kernel: thrown on a pool thread it ends the process
// (std::terminate); thrown on the caller's thread, where TensorFlow runs
// an eager op and Shard runs small work, it crosses TensorFlow's C API
// into its Python bindings, which fault (SIGSEGV).
#ifndef KRE_KERNELS_CHECKED_H_
#define KRE_KERNELS_CHECKED_H_

#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <utility>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/util/work_sharder.h"

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

// Runs fn(begin, end) over ranges of [0, n) on the intra-op pool, as
// tf::Shard does; an exception of fn becomes ResourceExhausted (the
// request's scratch did not fit) and the other ranges still run.
template <typename Fn>
absl::Status ShardChecked(::tensorflow::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit,
                          Fn&& fn) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  std::mutex mu;
  absl::Status status;
  ::tensorflow::Shard(
      workers->num_threads, workers->workers, n, cost_per_unit, [&](int64_t begin, int64_t end) {
        try {
          fn(begin, end);
        } catch (const std::bad_alloc&) {
          std::lock_guard<std::mutex> lock(mu);
          status = TooLarge();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          status = ::tensorflow::errors::ResourceExhausted("a request's work failed: ", e.what());
        }
      });
  return status;
}

}  // namespace kre

#endif  // KRE_KERNELS_CHECKED_H_
