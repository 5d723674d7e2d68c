// Copyright keras_rec_emb authors. Apache-2.0.
//
// The tables of the JAX binding. XLA has no resources: a table lives in a
// process-wide registry and the FFI handlers reach it by an integer handle,
// a static attribute of each call. Free of TensorFlow and of XLA.
//
// A handler holds the table through a shared_ptr for the length of its call,
// so a table destroyed while another thread's computation still uses it is
// freed when that call ends.
#ifndef KRE_JAX_TABLE_REGISTRY_H_
#define KRE_JAX_TABLE_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

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
class AnyTable {
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

 private:
  const int key_bits_;
  std::unique_ptr<kv::Table<int32_t>> t32_;
  std::unique_ptr<kv::Table<int64_t>> t64_;
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
