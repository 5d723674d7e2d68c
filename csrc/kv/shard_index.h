// Copyright keras_rec_emb authors. Apache-2.0.
//
// One shard's open-addressing index: keys -> {value row, metadata row}.
// Linear probing over 16-byte entries, power-of-two capacity, load factor
// (tombstones counted) <= 0.6, or 0.75 for a file tier's (see MaxLoad).
// A slot's state is its entry's row field
// (kEmptySlot, kDeletedSlot, or an occupied entry's row id or kNoRow), so a
// probe reads only the entries, four to a cache line: a lookup touches one
// line of the index where a separate array of control bytes made it two.
// Every probe goes through Probe(), the one probe loop. Not thread-safe: the
// table's shard lock guards it.
#ifndef KRE_KV_SHARD_INDEX_H_
#define KRE_KV_SHARD_INDEX_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kv/hash.h"
#include "kv/page_pool.h"
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
  static constexpr uint32_t kEmptySlot = kNoRow - 1;
  static constexpr uint32_t kDeletedSlot = kNoRow - 2;
  static constexpr uint64_t kMinCapacity = 16;
  static_assert(kDeletedSlot >= kMaxRows && kDeletedSlot < kEmptySlot && kEmptySlot < kNoRow,
                "the free-slot marks lie between every row id and kNoRow");
  static_assert(IsPowerOfTwo(kMinCapacity), "a probe wraps with & mask");

  struct Entry {
    K key;
    // Value (and slot) row; kNoRow while not admitted; kEmptySlot or
    // kDeletedSlot in a free slot (row ids stay below kMaxRows).
    uint32_t row;
    // The metadata row when the table tracks metadata (kNoRow for none);
    // otherwise the key's change epoch (table.h, "Change tracking"), kept
    // here so that it costs no bytes beyond the entry's own padding.
    uint32_t aux;
  };
  static_assert(sizeof(K) != 8 || sizeof(Entry) == 16,
                "an int64 key's entry is 16 bytes, four to a cache line");

  static bool Free(uint32_t row) { return row == kEmptySlot || row == kDeletedSlot; }

  // The slot of `key` (hash h), or -1.
  int64_t Find(K key, uint64_t h) const {
    const Entry* e = FindIn(data(), mask_, key, h);  // data(): also without storage
    return e ? e - entries_.data() : -1;
  }

  // Find over the entries `entries` of a non-empty index with mask `mask`
  // (see data()): the entry of `key`, or nullptr. The key is compared
  // before the slot's state: a hit, the common case, is not first tested
  // for an empty slot.
  __attribute__((always_inline)) static const Entry* FindIn(const Entry* entries, uint64_t mask,
                                                            K key, uint64_t h) {
    const Entry* found = nullptr;
    Probe(h, mask, [&](uint64_t i) {
      const Entry& e = entries[i];
      if (e.key == key && !Free(e.row)) {
        found = &e;
        return true;
      }
      return e.row == kEmptySlot;
    });
    return found;
  }

  // The most of an index's slots that live keys and tombstones may fill,
  // num / den. Linear probing leaves the keys inserted last the furthest
  // from their home slots, and every probe of theirs that passes a slot
  // costs a branch, often a mispredicted one, sometimes a line, so lookups
  // of late keys slow down as the load grows. kMaxLoad (0.6) is for tables
  // whose rows live in DRAM, where the index is about a sixth of the bytes
  // per key, so a sparser index costs little memory and buys shorter
  // probes; kCompactMaxLoad (0.75) is for a file tier, where the index is
  // most of the DRAM per key (measurements: docs/history.md, session 16).
  struct MaxLoad {
    uint64_t num, den;
  };
  static constexpr MaxLoad kMaxLoad{3, 5};
  static constexpr MaxLoad kCompactMaxLoad{3, 4};
  static_assert(kMaxLoad.num < kMaxLoad.den && kCompactMaxLoad.num < kCompactMaxLoad.den,
                "an index is never full: Probe() stops at a free slot");

  // Makes room for one more key: when the slots in use would pass `limit`,
  // doubles the capacity if live keys alone fill more than half of what
  // `limit` allows, else rehashes in place (the load is mostly tombstones).
  // No default: the caller knows its tier. Call before Insert; may throw
  // bad_alloc, leaving the index as it was.
  void Reserve(MaxLoad limit) {
    const uint64_t cap = entries_.size();
    if ((live_ + tombstones_ + 1) * limit.den > cap * limit.num) {
      uint64_t new_cap = cap == 0 ? kMinCapacity : cap;
      if ((live_ + 1) * 2 * limit.den > cap * limit.num) {
        new_cap = std::max(kMinCapacity, cap * 2);
      }
      Rehash(new_cap);
    }
  }

  // Inserts an absent key (after Reserve); returns its slot. e.row is a row
  // id or kNoRow.
  uint64_t Insert(K key, uint64_t h, Entry e) {
    const uint64_t i = Probe(h, mask_, [&](uint64_t j) { return Free(entries_[j].row); });
    if (entries_[i].row == kDeletedSlot) --tombstones_;
    e.key = key;
    entries_[i] = e;
    ++live_;
    UpdateReach();
    return i;
  }

  // Removes the entry at slot i (the caller frees its rows first).
  void EraseAt(uint64_t i) {
    // With linear probing a slot followed by an empty one ends every probe
    // chain through it, so it can become empty instead of a tombstone.
    if (entries_[(i + 1) & mask_].row == kEmptySlot) {
      entries_[i].row = kEmptySlot;
    } else {
      entries_[i].row = kDeletedSlot;
      ++tombstones_;
    }
    --live_;
    UpdateReach();
  }

  bool Occupied(uint64_t i) const { return !Free(entries_[i].row); }
  uint64_t capacity() const { return entries_.size(); }
  uint64_t live() const { return live_; }
  uint64_t mask() const { return mask_; }
  Entry& entry(uint64_t i) { return entries_[i]; }
  const Entry& entry(uint64_t i) const { return entries_[i]; }
  // Prefetches the line of hash h's home slot and that of slot h + reach
  // (the next line when the probe may cross into it): a probe that crosses
  // into an unfetched line waits on a second miss. reach() is 3 (the first
  // four slots of the probe) above load 0.4, where many keys found sit past
  // their home slot's line and h+3 covers more of them than h+1. At load
  // <= 0.4 few keys sit past their home slot, and reach() is 1: the second
  // line is fetched only for a home slot last in its line, 1.25 lines a key
  // instead of 1.75 (measurements: docs/history.md, sessions 13 and 18).
  // For an index with storage; the static form for FindIn's (entries, mask).
  KRE_KV_INLINE static void PrefetchProbe(const Entry* entries, uint64_t mask, uint64_t h,
                                          uint64_t reach) {
    __builtin_prefetch(&entries[h & mask]);
    __builtin_prefetch(&entries[(h + reach) & mask]);
  }
  void PrefetchProbe(uint64_t h) const { PrefetchProbe(entries_.data(), mask_, h, reach_); }
  uint64_t reach() const { return reach_; }
  bool empty_storage() const { return entries_.empty(); }
  // The entries, for FindIn (with mask()): valid until the index changes.
  // An index without storage gives one empty slot (mask() is 0).
  const Entry* data() const { return entries_.empty() ? kNoEntries : entries_.data(); }

  uint64_t MemoryBytes() const { return entries_.capacity() * sizeof(Entry); }

  void Clear() {
    entries_.clear();
    entries_.shrink_to_fit();
    mask_ = 0;
    live_ = 0;
    tombstones_ = 0;
    UpdateReach();
  }

  void Swap(ShardIndex& o) {
    std::swap(entries_, o.entries_);
    std::swap(mask_, o.mask_);
    std::swap(live_, o.live_);
    std::swap(tombstones_, o.tombstones_);
    std::swap(reach_, o.reach_);
  }

 private:
  void Rehash(uint64_t new_capacity) {
    Entries entries(new_capacity, Entry{K(), kEmptySlot, 0});
    const uint64_t mask = new_capacity - 1;
    for (const Entry& e : entries_) {
      if (Free(e.row)) continue;
      const uint64_t h = HashKey(static_cast<uint64_t>(static_cast<int64_t>(e.key)));
      const uint64_t j = Probe(h, mask, [&](uint64_t k) { return entries[k].row == kEmptySlot; });
      entries[j] = e;
    }
    entries_.swap(entries);
    mask_ = mask;
    tombstones_ = 0;
    UpdateReach();
  }
  // PrefetchProbe's second slot for the current load (see there).
  void UpdateReach() { reach_ = (live_ + tombstones_) * 5 <= entries_.size() * 2 ? 1 : 3; }

  static constexpr Entry kNoEntries[1] = {{K(), kEmptySlot, 0}};

  // On PagePool's huge pages: a probe misses the TLB far less often.
  using Entries = std::vector<Entry, PoolAllocator<Entry>>;
  Entries entries_;
  uint64_t mask_ = 0;
  uint64_t live_ = 0;
  uint64_t tombstones_ = 0;
  uint64_t reach_ = 1;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_SHARD_INDEX_H_
