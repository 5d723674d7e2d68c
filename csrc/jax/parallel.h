// Copyright keras_rec_emb authors. Apache-2.0.
//
// A handler's work split over XLA's intra-op thread pool (the FFI's
// ffi::ThreadPool, the pool XLA:CPU runs its own compute on): units
// 0 .. n-1, each one table shard's part, run by the calling thread and by
// tasks of the pool, whichever claims a unit first. The FFI promises
// neither that the tasks run concurrently nor that they run before the
// handler returns (a pool of one thread, or tasks run on the caller), so
// the caller never waits for a task to start: it runs every unit no task
// has claimed, then waits only for the units tasks are running. A task
// that starts after that finds none left and touches only the shared
// state it holds. A unit's work is the same whichever thread runs it, so
// the results do not depend on the number of threads.
#ifndef KRE_JAX_PARALLEL_H_
#define KRE_JAX_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace kre {
namespace jaxbind {

namespace parallel_internal {

// What the caller and its tasks share: the next unclaimed unit, how many
// are finished, and the first exception a unit threw.
struct Units {
  explicit Units(int64_t n, const std::function<void(int64_t)>* fn) : n(n), fn(fn) {}

  // Runs the units this thread claims; true when it finished the last one.
  bool RunClaimed() {
    bool last = false;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      last = done.fetch_add(1, std::memory_order_acq_rel) + 1 == n;
    }
    return last;
  }

  const int64_t n;
  // Valid while a unit is unfinished (the caller waits for all of them).
  const std::function<void(int64_t)>* const fn;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable finished;
  std::exception_ptr error;
};

}  // namespace parallel_internal

// Distinct ids a thread takes at least in a table call split over the pool:
// a part then holds about a millisecond of table work, far more than
// waking a thread of the pool costs. Smaller calls (a group's tables of a
// few thousand ids each) run on the calling thread alone: split by shard,
// their parts were too small to pay for the pool (measured more CPU time
// per step, and no shorter steps, on two threads).
constexpr int64_t kMinIdsPerThread = 16384;

// The threads of `pool` a call with `ids` ids is split over (1: the
// calling thread alone).
inline int64_t ThreadsFor(ffi::ThreadPool& pool, int64_t ids) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), ids / kMinIdsPerThread));
}

// Runs fn(i) for i in [0, n), on at most `threads` threads of `pool` (the
// caller's included; threads <= 0: all of the pool's), and rethrows the
// first exception a unit threw. One unit, or a pool of one thread, runs on
// the caller alone, with nothing scheduled.
inline void ParallelFor(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& fn,
                        int64_t threads = 0) {
  const int64_t pool_threads = pool.num_threads();
  const int64_t tasks =
      std::min<int64_t>(threads > 0 ? std::min(threads, pool_threads) : pool_threads, n) - 1;
  if (tasks <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto units = std::make_shared<parallel_internal::Units>(n, &fn);
  for (int64_t t = 0; t < tasks; ++t) {
    pool.Schedule([units] {
      if (units->RunClaimed()) {
        std::lock_guard<std::mutex> lock(units->mu);
        units->finished.notify_all();
      }
    });
  }
  units->RunClaimed();
  {
    std::unique_lock<std::mutex> lock(units->mu);
    units->finished.wait(lock, [&] { return units->done.load(std::memory_order_acquire) == n; });
  }
  if (units->error) std::rethrow_exception(units->error);
}

}  // namespace jaxbind
}  // namespace kre

#endif  // KRE_JAX_PARALLEL_H_
