// Copyright keras_rec_emb authors. Apache-2.0.
//
// The tables of the JAX binding. XLA has no resources: a table lives in a
// process-wide registry and the FFI handlers reach it by an integer handle,
// a static attribute of each call. Free of TensorFlow and of XLA.
//
// A handler holds the table through a shared_ptr for the length of its call,
// so a table destroyed while another thread's computation still uses it is
// freed when that call ends.
//
// An update's table part, whose result no call waits for, may run on XLA's
// intra-op pool after its handler returned (AnyTable::Defer): every later
// use of the table settles it first (AnyTable::Settle), so each table's
// calls still take effect one after another, in program order, while the
// calling thread goes on with other tables.
#ifndef KRE_JAX_TABLE_REGISTRY_H_
#define KRE_JAX_TABLE_REGISTRY_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "core/share_work.h"
#include "kv/table.h"

namespace kre {
namespace jaxbind {

// The key type of a kv::Table (for generic lambdas over AnyTable::Visit).
template <typename T>
struct KeyOf;
template <typename K>
struct KeyOf<kv::Table<K>> {
  using type = K;
};
template <typename T>
using KeyOfT = typename KeyOf<std::decay_t<T>>::type;

// A table with int32 or int64 keys (JAX gives int32 ids unless x64 is on).
class AnyTable : public std::enable_shared_from_this<AnyTable> {
 public:
  AnyTable(int key_bits, kv::TableOptions options) : key_bits_(key_bits) {
    if (key_bits == 64) {
      t64_ = std::make_unique<kv::Table<int64_t>>(std::move(options));
    } else {
      t32_ = std::make_unique<kv::Table<int32_t>>(std::move(options));
    }
  }
  int key_bits() const { return key_bits_; }
  int64_t dim() const { return key_bits_ == 64 ? t64_->dim() : t32_->dim(); }

  // fn(table) with the table typed by its key type.
  template <typename Fn>
  decltype(auto) Visit(Fn&& fn) {
    if (key_bits_ == 64) return fn(*t64_);
    return fn(*t32_);
  }

  // Hands `work` (the table part of an update) to whichever thread settles
  // the table first: the pool's task (RunDeferred) or the table's next use
  // (Settle). Work deferred before is settled first.
  void Defer(std::function<void()> work) {
    std::unique_lock<std::mutex> lock(mu_);
    Drain(lock);
    deferred_ = std::move(work);
  }
  // Runs the deferred work here if no thread has started it, else waits for
  // it; then rethrows (once) what deferred work raised since the last
  // Settle: an update's failure reaches the table's next call.
  void Settle() {
    std::unique_lock<std::mutex> lock(mu_);
    Drain(lock);
    if (failure_ != nullptr) std::rethrow_exception(std::exchange(failure_, nullptr));
  }
  // The pool's task: runs the deferred work if no thread has (its failure
  // kept for the next Settle).
  void RunDeferred() {
    std::unique_lock<std::mutex> lock(mu_);
    Drain(lock);
  }

 private:
  void Drain(std::unique_lock<std::mutex>& lock) {
    for (;;) {
      if (deferred_) {
        std::function<void()> work = std::move(deferred_);
        deferred_ = nullptr;
        running_ = true;
        lock.unlock();
        std::exception_ptr failure;
        // Named as an earlier update's failure (its kind kept: a file
        // tier's DataLossError stays one).
        try {
          work();
        } catch (const kv::DataLossError& e) {
          failure = std::make_exception_ptr(kv::DataLossError(std::string(kEarlier) + e.what()));
        } catch (const std::exception& e) {
          failure = std::make_exception_ptr(std::runtime_error(std::string(kEarlier) + e.what()));
        } catch (...) {  // never escapes with running_ set (later uses would wait forever)
          failure = std::make_exception_ptr(std::runtime_error(std::string(kEarlier) + "unknown"));
        }
        lock.lock();
        running_ = false;
        if (failure != nullptr && failure_ == nullptr) failure_ = failure;
        settled_.notify_all();
      } else if (running_) {
        settled_.wait(lock);
      } else {
        return;
      }
    }
  }

  static constexpr const char* kEarlier = "an earlier update of this table failed: ";
  const int key_bits_;
  std::unique_ptr<kv::Table<int32_t>> t32_;
  std::unique_ptr<kv::Table<int64_t>> t64_;
  std::mutex mu_;
  std::condition_variable settled_;
  std::function<void()> deferred_;  // guarded by mu_
  bool running_ = false;            // guarded by mu_
  std::exception_ptr failure_;      // guarded by mu_
};

class Registry {
 public:
  // The handle of the new table (>= 1), or -1 when 2^31 - 1 handles were
  // given out (a handle is an int32 in JAX's default mode).
  int64_t Add(std::shared_ptr<AnyTable> table) {
    std::lock_guard<std::mutex> lock(mu_);
    if (next_ > INT32_MAX) return -1;
    const int64_t handle = next_++;
    tables_.emplace(handle, std::move(table));
    return handle;
  }
  std::shared_ptr<AnyTable> Get(int64_t handle) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tables_.find(handle);
    return it == tables_.end() ? nullptr : it->second;
  }
  bool Remove(int64_t handle) {
    std::shared_ptr<AnyTable> doomed;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tables_.find(handle);
    if (it == tables_.end()) return false;
    doomed = std::move(it->second);
    tables_.erase(it);
    return true;
  }
  int64_t Count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(tables_.size());
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<AnyTable>> tables_;
  int64_t next_ = 1;
};

// The process's registry (never destroyed: handlers may run during exit).
inline Registry& Tables() {
  static Registry* registry = new Registry;
  return *registry;
}

}  // namespace jaxbind
}  // namespace kre

#endif  // KRE_JAX_TABLE_REGISTRY_H_
