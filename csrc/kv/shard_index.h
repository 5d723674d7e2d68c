// Copyright keras_rec_emb authors. Apache-2.0.
//
// One shard's open-addressing index: keys -> {value row, metadata row}.
// One control byte per slot (kEmpty, kDeleted or the key's 7-bit tag) kept
// apart from the entries, linear probing, power-of-two capacity, load factor
// <= 0.75 with tombstones counted. Every probe goes through Probe(), the one
// probe loop. Not thread-safe: the table's shard lock guards it.
#ifndef KRE_KV_SHARD_INDEX_H_
#define KRE_KV_SHARD_INDEX_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kv/hash.h"
#include "kv/row_store.h"  // kNoRow

namespace kre {
namespace kv {

// Walks the probe sequence of hash h over a power-of-two table of `mask + 1`
// slots from h's home slot, calling visit(i) until it returns true; returns
// that slot. The caller guarantees that visit stops (a table is never full).
template <typename Visit>
inline uint64_t Probe(uint64_t h, uint64_t mask, Visit&& visit) {
  uint64_t i = h & mask;
  while (!visit(i)) i = (i + 1) & mask;
  return i;
}

template <typename K>
class ShardIndex {
 public:
  static constexpr uint8_t kEmpty = 0x80;
  static constexpr uint8_t kDeleted = 0xFE;
  static constexpr uint64_t kMinCapacity = 16;

  struct Entry {
    K key;
    uint32_t row;       // value (and slot) row; kNoRow while not admitted
    // The metadata row when the table tracks metadata (kNoRow for none);
    // otherwise the key's change epoch (table.h, "Change tracking"), kept
    // here so that it costs no bytes beyond the entry's own padding.
    uint32_t aux;
  };

  // The slot of `key` (hash h), or -1.
  int64_t Find(K key, uint64_t h) const {
    if (ctrl_.empty()) return -1;
    const uint8_t tag = TagOfHash(h);
    int64_t found = -1;
    Probe(h, mask_, [&](uint64_t i) {
      const uint8_t c = ctrl_[i];
      if (c == tag && entries_[i].key == key) {
        found = static_cast<int64_t>(i);
        return true;
      }
      return c == kEmpty;
    });
    return found;
  }

  // Makes room for one more key (grows, or rehashes in place when the load
  // is mostly tombstones). Call before Insert; may throw bad_alloc, leaving
  // the index as it was.
  void Reserve() {
    const uint64_t cap = ctrl_.size();
    if ((live_ + tombstones_ + 1) * 4 > cap * 3) {
      uint64_t new_cap = cap == 0 ? kMinCapacity : cap;
      if ((live_ + 1) * 8 > cap * 3) new_cap = std::max(kMinCapacity, cap * 2);
      Rehash(new_cap);
    }
  }

  // Inserts an absent key (after Reserve); returns its slot.
  uint64_t Insert(K key, uint64_t h, Entry e) {
    const uint64_t i = Probe(h, mask_, [&](uint64_t j) { return (ctrl_[j] & 0x80) != 0; });
    if (ctrl_[i] == kDeleted) --tombstones_;
    ctrl_[i] = TagOfHash(h);
    e.key = key;
    entries_[i] = e;
    ++live_;
    return i;
  }

  // Removes the entry at slot i (the caller frees its rows first).
  void EraseAt(uint64_t i) {
    // With linear probing a slot followed by an empty one ends every probe
    // chain through it, so it can become empty instead of a tombstone.
    if (ctrl_[(i + 1) & mask_] == kEmpty) {
      ctrl_[i] = kEmpty;
    } else {
      ctrl_[i] = kDeleted;
      ++tombstones_;
    }
    --live_;
  }

  bool Occupied(uint64_t i) const { return !(ctrl_[i] & 0x80); }
  uint64_t capacity() const { return ctrl_.size(); }
  uint64_t live() const { return live_; }
  uint64_t mask() const { return mask_; }
  Entry& entry(uint64_t i) { return entries_[i]; }
  const Entry& entry(uint64_t i) const { return entries_[i]; }
  // For prefetching the home slot of hash h.
  const void* CtrlAddress(uint64_t h) const { return &ctrl_[h & mask_]; }
  const void* EntryAddress(uint64_t h) const { return &entries_[h & mask_]; }
  bool empty_storage() const { return ctrl_.empty(); }

  uint64_t MemoryBytes() const {
    return ctrl_.capacity() + entries_.capacity() * sizeof(Entry);
  }

  void Clear() {
    ctrl_.clear();
    ctrl_.shrink_to_fit();
    entries_.clear();
    entries_.shrink_to_fit();
    mask_ = 0;
    live_ = 0;
    tombstones_ = 0;
  }

  void Swap(ShardIndex& o) {
    std::swap(ctrl_, o.ctrl_);
    std::swap(entries_, o.entries_);
    std::swap(mask_, o.mask_);
    std::swap(live_, o.live_);
    std::swap(tombstones_, o.tombstones_);
  }

 private:
  void Rehash(uint64_t new_capacity) {
    std::vector<uint8_t> ctrl(new_capacity, kEmpty);
    std::vector<Entry> entries(new_capacity);
    const uint64_t mask = new_capacity - 1;
    for (uint64_t i = 0; i < ctrl_.size(); ++i) {
      if (ctrl_[i] & 0x80) continue;
      const uint64_t h = HashKey(static_cast<uint64_t>(static_cast<int64_t>(entries_[i].key)));
      const uint64_t j = Probe(h, mask, [&](uint64_t k) { return ctrl[k] == kEmpty; });
      ctrl[j] = TagOfHash(h);
      entries[j] = entries_[i];
    }
    ctrl_.swap(ctrl);
    entries_.swap(entries);
    mask_ = mask;
    tombstones_ = 0;
  }

  std::vector<uint8_t> ctrl_;  // kEmpty, kDeleted, or a 7-bit hash tag.
  std::vector<Entry> entries_;
  uint64_t mask_ = 0;
  uint64_t live_ = 0;
  uint64_t tombstones_ = 0;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_SHARD_INDEX_H_
