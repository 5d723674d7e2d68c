// Copyright keras_rec_emb authors. Apache-2.0.
//
// ShareWork: a call's items split among its calling thread and pool
// threads, each thread taking the next item not yet taken. Used by the JAX
// handlers (XLA's intra-op pool) and the TensorFlow kernels' ParallelFor
// (TensorFlow's): items of uneven cost, or few of them per thread, leave no
// thread waiting on a block another thread still works through. Free of
// TensorFlow and of XLA.
#ifndef KRE_CORE_SHARE_WORK_H_
#define KRE_CORE_SHARE_WORK_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace kre {

// Runs fn(i) for every i in [0, n) on the calling thread and on up to
// `helpers` more threads, each thread taking the next i not yet taken:
// schedule(task) hands `task` to a pool thread (XLA's or TensorFlow's
// intra-op pool). The
// caller waits only for items a thread has taken, so a helper that starts
// late (its pool busy, or all its threads waiting) finds nothing left and
// never holds the caller up, and none touches `fn` after the caller
// returned. The first exception of an item is rethrown on the calling
// thread once every taken item is done.
template <typename Schedule, typename Fn>
void ShareWork(int64_t helpers, Schedule&& schedule, int64_t n, Fn&& fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable all_done;
    int64_t done = 0;            // guarded by mu
    std::exception_ptr failure;  // guarded by mu
    std::function<void(int64_t)> item;
    int64_t n = 0;
    // Items until none is left; returns after the last one it took.
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        std::exception_ptr f;
        try {
          item(i);
        } catch (...) {
          f = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(mu);
        if (failure == nullptr) failure = std::move(f);
        f = nullptr;  // dropped under the lock, like `failure` (see below)
        if (++done == n) all_done.notify_all();
      }
    }
  };
  if (n <= 0) return;
  auto state = std::make_shared<State>();
  state->n = n;
  state->item = std::ref(fn);
  for (int64_t h = 0; h < std::min(helpers, n - 1); ++h) {
    schedule([state] { state->Work(); });
  }
  state->Work();
  std::exception_ptr failure;
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->all_done.wait(lock, [&] { return state->done == n; });
    // Taken out of the state: a helper may still hold the state, and the
    // exception is then released by the thread that handles it, not by the
    // helper dropping the last reference behind the caller's back.
    failure = std::move(state->failure);
  }
  if (failure != nullptr) std::rethrow_exception(failure);
}

}  // namespace kre

#endif  // KRE_CORE_SHARE_WORK_H_
