// Copyright keras_rec_emb authors. Apache-2.0.
//
// The embedding table: a collision-free hash map from integer keys to float
// rows of fixed width `dim`, free of TensorFlow.
//
// * The key space is split into shards by hash bits; each shard has its own
//   reader/writer lock, open-addressing index (one control byte per slot kept
//   apart from the {key, value_row, meta_row} entries, linear probing,
//   power-of-two capacity, load factor <= 0.75 with tombstones counted) and
//   its own arenas.
// * Rows live in chunked arenas that never move; optimizer slots live in
//   parallel arenas indexed by the same value row id. Per-key metadata
//   (frequency, version) lives in a separate arena, only when tracked.
//   Erased rows go to free lists.
// * A new key k starts as a copy of default row (k mod default_value_dim) of
//   the [default_value_dim, dim] matrix given at construction (DeepRec's EV
//   Initializer).
// * Admission filters (DeepRec's feature filter): with a counter filter a
//   key seen fewer than `filter_freq` times has an index entry and metadata
//   but no value or slot rows; it reads `no_permission_value` and its
//   gradients are dropped. With a counting Bloom filter, keys are counted in
//   one counting Bloom filter of the whole table (sized for the table, not
//   split over shards; counters updated atomically) and enter the index
//   only once admitted. As in DeepRec, a key's count before a training
//   lookup decides what it reads: the lookup that brings the count to the
//   threshold admits the key (its row exists, so this step's gradient
//   trains it) but still reads no_permission_value, and every occurrence of
//   a key in one lookup reads the same value.
// * Eviction (GlobalStepEvict, L2WeightEvict) erases keys on demand.
//
// Batched operations take the keys of one shard with their hashes and their
// positions in the batch (see Partition in partition.h) and lock that shard
// once.
#ifndef KRE_KV_TABLE_H_
#define KRE_KV_TABLE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kv/arena.h"

namespace kre {
namespace kv {

// splitmix64 finalizer: a strong, cheap mix so that sequential ids spread.
inline uint64_t HashKey(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

struct TableOptions {
  int64_t dim = 0;
  std::vector<float> default_values;  // [default_value_dim, dim]
  int num_shards = 32;                // any value in [1, 65536]
  bool track_meta = true;             // per-key frequency and version
  int64_t filter_freq = 0;            // admission threshold; <= 1: none
  // Counting Bloom filter (when bloom_counters > 0): total counters, hashes
  // per key, and bytes per counter (1, 2, 4 or 8; counters saturate).
  uint64_t bloom_counters = 0;
  int bloom_hashes = 0;
  int bloom_counter_bytes = 8;
  float no_permission_value = 0.0f;   // what keys not yet admitted read
  // > 0: a key's frequency stops growing at this count (DeepRec's default
  // with a filter: an admitted key reports `filter_freq` unless
  // TF_RECORD_FREQ=1); 0: every training-lookup occurrence counts.
  int64_t freq_cap = 0;
};

// Counting Bloom filter parameters for n expected keys and false-positive
// probability p: m = ceil(-n ln p / ln(2)^2) counters, k = round(m/n ln 2).
void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes);

struct SlotSpec {
  std::string name;
  int64_t width;
  float init;
};

// Per-row metadata columns.
enum MetaColumn { kFreq = 0, kVersion = 1, kNumMeta = 2 };

template <typename K>
class Table {
 public:
  explicit Table(TableOptions options);
  // A table without filters that tracks metadata.
  Table(int64_t dim, std::vector<float> default_values, int num_shards);
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  static uint64_t Hash(K key) {
    return HashKey(static_cast<uint64_t>(static_cast<int64_t>(key)));
  }
  // Bits 24..55 of the hash scaled to [0, num_shards) by a multiply (any
  // shard count; apart from the slot bits (low) and the tag bits (57..63)).
  int ShardOf(uint64_t h) const {
    return static_cast<int>((((h >> 24) & 0xFFFFFFFFULL) * num_shards_) >> 32);
  }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  int64_t dim() const { return dim_; }
  int64_t default_value_dim() const { return default_value_dim_; }

  // The EV-initializer row of `key`.
  const float* DefaultRow(K key) const;
  // The EV-initializer matrix [default_value_dim, dim], row-major.
  std::vector<float> DefaultValues() const;
  // Replaces it (rows added from now on use the new matrix).
  void SetDefaultValues(std::vector<float> default_values);

  const TableOptions& options() const { return options_; }
  bool filtering() const { return options_.filter_freq > 1; }
  bool bloom() const { return options_.bloom_counters > 0; }

  // Number of admitted keys (those with rows).
  int64_t Size() const;
  // Number of keys counted by the counter filter but not admitted yet.
  int64_t FilteredSize() const;
  // The latest step stamped by Apply (the table's notion of "now"); -1
  // before any. A training lookup belongs to the step after it.
  int64_t LatestStep() const { return latest_step_.load(std::memory_order_relaxed); }
  // Bytes held by index, arenas and free lists.
  uint64_t MemoryBytes() const;

  // Looks up keys[0..n) (all in shard `shard`, with their hashes), writing
  // the row of keys[j] to out + order[j] * dim. With `insert` (training),
  // every occurrence counts towards the key's frequency; with a filter, a
  // key admitted before this call reads its row and any other key reads
  // `no_permission_value` (all its occurrences alike), and keys whose count
  // reaches the admission threshold get their default row, read from the
  // next lookup on. Without `insert` (inference) nothing changes:
  // admitted keys read their rows, others their default row (or
  // `no_permission_value` when a filter is on). Returns the number of keys
  // admitted.
  int64_t Lookup(int shard, const K* keys, const uint64_t* hashes,
                 const int64_t* order, int64_t n, bool insert, float* out);
  // Lookup of distinct keys, keys[j] standing for counts[order[j]] >= 1
  // occurrences in a batch: the table ends as if the batch had been looked
  // up by Lookup, and every occurrence reads what Lookup gives it.
  // skips[order[j]] is set to 0 (kept for callers that read it: every
  // occurrence of a key reads the same row).
  int64_t LookupCounted(int shard, const K* keys, const uint64_t* hashes,
                        const int64_t* order, const int32_t* counts, int64_t n,
                        bool insert, float* out, int32_t* skips);
  // What keys not yet admitted read: dim() copies of no_permission_value.
  const float* NoPermissionRow() const { return no_permission_row_.data(); }

  // Sums the gradient rows (grads + order[j] * dim) of equal keys among
  // keys[0..n) (all in shard `shard`, with their hashes), and for each
  // distinct admitted key stamps its version with `step` and calls
  // fn(value_row, slot_rows, grad_sum) with slot_rows[j] the row of slot
  // slot_ids[j]. Missing keys are inserted first when no filter is on; with
  // a filter, gradients of keys not admitted are dropped.
  template <typename Fn>
  void Apply(int shard, const K* keys, const uint64_t* hashes,
             const int64_t* order, int64_t n, const float* grads,
             const std::vector<int>& slot_ids, int64_t step, Fn&& fn);

  // Slots: parallel per-row state of the optimizer. AddSlot returns the slot
  // index; if the slot exists its width must match and its init value (for
  // rows created from now on) is replaced.
  int AddSlot(const std::string& name, int64_t width, float init);
  int SlotIndex(const std::string& name) const;  // -1 when absent.
  std::vector<SlotSpec> Slots() const;

  // Exports every key. `alloc(n, nf)` is called once, with every shard
  // locked, and returns buffers for n admitted keys: keys[n], values[n,
  // dim], freqs[n], versions[n], slots[n, total_slot_width] (slot columns
  // in slot order); and for nf keys counted but not admitted (counter
  // filter): keys_filtered, freqs_filtered, versions_filtered. It may
  // return std::nullopt to abandon the export.
  struct ExportBuffers {
    K* keys;
    float* values;
    int64_t* freqs;
    int64_t* versions;
    float* slots;
    K* keys_filtered;
    int64_t* freqs_filtered;
    int64_t* versions_filtered;
  };
  template <typename Alloc>
  void Export(Alloc&& alloc) const;
  // The Bloom counters, shard after shard (empty without a Bloom filter).
  std::vector<uint8_t> BloomState() const;
  // Restores them if `state` has this table's size; returns whether it did.
  bool SetBloomState(const std::vector<uint8_t>& state);
  // The estimated count of `key` in the Bloom filter (0 without one).
  uint64_t BloomCount(K key) const;

  // Inserts or overwrites n rows. `slot_ids[j]` names the table slot that
  // column block j of `slots` ([n, sum(widths)]) holds; `slot_widths[j]` its
  // width. freqs/versions may be null (then zero); a negative freqs[i]
  // keeps the frequency of a key already present (0 for a new one).
  void Import(const K* keys, const float* values, const int64_t* freqs,
              const int64_t* versions, int64_t n, const float* slots,
              const std::vector<int>& slot_ids,
              const std::vector<int64_t>& slot_widths);
  // Inserts keys counted but not admitted, with their counts; a key that is
  // already admitted stays admitted. They are admitted by the lookup that
  // brings their count to the (current) threshold.
  void ImportFiltered(const K* keys, const int64_t* freqs, const int64_t* versions,
                      int64_t n);

  // Erases keys: admitted keys whose version is older than
  // now - steps_to_live (when steps_to_live >= 0), admitted keys with
  // 0.5 * sum(row**2) < l2_threshold (DeepRec's L2WeightEvict rule; when
  // l2_threshold >= 0), and keys not
  // admitted whose last lookup is older than now - steps_to_live. `now` < 0
  // means LatestStep(). Returns the number of keys erased.
  int64_t Evict(int64_t now, int64_t steps_to_live, float l2_threshold);

  bool Erase(K key);
  void Clear();
  // Exchanges the contents (keys, rows, slots, metadata, Bloom counters,
  // slot specs, initializer matrix) of this table and `other`, a table of
  // the same shape (dim, shards, filters) that no other thread uses. The
  // latest step becomes the larger of the two. With every shard of this
  // table locked, so concurrent operations see the old or the new
  // contents. Throws std::invalid_argument, changing nothing, when the
  // shapes differ or this table has a slot that `other` lacks (one added
  // while `other` was filled).
  void SwapContents(Table& other);
  // Reads one key if present, for tests and tools: its value (empty when
  // not admitted), frequency and version.
  bool Find(K key, std::vector<float>* value, int64_t* freq,
            int64_t* version) const;

 private:
  static constexpr uint8_t kEmpty = 0x80;
  static constexpr uint8_t kDeleted = 0xFE;
  static constexpr uint64_t kMinCapacity = 16;
  static constexpr uint32_t kNoRow = UINT32_MAX;

  struct Entry {
    K key;
    uint32_t row;       // value (and slot) row; kNoRow while not admitted
    uint32_t meta_row;  // metadata row; kNoRow when not tracked
  };

  struct Shard {
    mutable std::shared_mutex mu;
    std::vector<uint8_t> ctrl;  // kEmpty, kDeleted, or a 7-bit hash tag.
    std::vector<Entry> entries;
    uint64_t mask = 0;
    uint64_t live = 0;
    uint64_t tombstones = 0;
    ChunkedArena<float> values;
    std::vector<ChunkedArena<float>> slots;
    uint32_t next_row = 0;
    std::vector<uint32_t> free_rows;
    ChunkedArena<int64_t> meta{kNumMeta};
    uint32_t next_meta = 0;
    std::vector<uint32_t> free_meta;
    uint64_t filtered = 0;       // entries not admitted
  };

  static uint8_t Tag(uint64_t h) { return static_cast<uint8_t>(h >> 57); }
  int64_t FindIndex(const Shard& s, K key, uint64_t h) const;
  // Inserts a missing key; with `admit` it gets value and slot rows. Returns
  // its index position.
  uint64_t InsertNew(Shard& s, K key, uint64_t h, bool admit);
  // Gives entry i its value and slot rows, initialized for its key.
  uint32_t Admit(Shard& s, uint64_t i);
  // The frequency after `count` more occurrences (saturating, and at most
  // options_.freq_cap when that is > 0).
  int64_t CountFreq(int64_t freq, int64_t count) const;
  int64_t* Meta(const Shard& s, const Entry& e) const {
    return e.meta_row == kNoRow ? nullptr : s.meta.Row(e.meta_row);
  }
  // One key's row for Lookup (see there); counts admissions in *admitted.
  const float* Resolve(Shard& s, K key, uint64_t h, bool insert, int64_t now,
                       int64_t count, int64_t* admitted, int64_t* skip);
  template <bool kCounted>
  int64_t LookupImpl(int shard, const K* keys, const uint64_t* hashes,
                     const int64_t* order, const int32_t* counts, int64_t n,
                     bool insert, float* out, int32_t* skips);
  // Adds one sighting of hash h to the Bloom counters (atomically: several
  // shards share them); returns the estimated count (the smallest of its
  // counters).
  uint64_t BloomAdd(uint64_t h);
  uint64_t BloomMin(uint64_t h) const;
  // The counter of hash h's k-th Bloom position.
  uint64_t BloomSlot(uint64_t h, int k) const;
  void Rehash(Shard& s, uint64_t new_capacity);
  void EraseAt(Shard& s, uint64_t i);
  void ResetShard(Shard& s);
  void RaiseLatestStep(int64_t step);

  const TableOptions options_;
  const int64_t dim_;
  // Read under any shard lock, replaced with every shard locked.
  std::vector<float> default_values_;
  int64_t default_value_dim_;
  uint64_t num_shards_;
  // The Bloom counters (bloom_counters * bloom_counter_bytes bytes, in
  // 8-byte words so that every counter is naturally aligned for atomics).
  std::vector<uint64_t> bloom_words_;
  std::vector<float> no_permission_row_;
  std::atomic<int64_t> latest_step_{-1};
  std::vector<std::unique_ptr<Shard>> shards_;
  // Changed only with every shard locked exclusively, so holding any shard
  // lock gives a consistent view.
  std::vector<SlotSpec> slot_specs_;
  mutable std::mutex slot_specs_mu_;  // for readers that hold no shard lock
};

// ---------------------------------------------------------------------------
// Template members used by kernels with their own functors.

template <typename K>
template <typename Fn>
void Table<K>::Apply(int shard, const K* keys, const uint64_t* hashes,
                     const int64_t* order, int64_t n, const float* grads,
                     const std::vector<int>& slot_ids, int64_t step, Fn&& fn) {
  RaiseLatestStep(step);
  Shard& s = *shards_[shard];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  // Distinct admitted keys in first-seen order with their summed gradient.
  // Row ids (stable while inserts rehash the index) identify them; a small
  // open-addressing map from row id to position dedupes equal keys.
  std::vector<Entry> hits;
  std::vector<float> sums;
  hits.reserve(n);
  sums.reserve(n * dim_);
  uint64_t cap = 16;
  while (cap < static_cast<uint64_t>(n) * 2) cap <<= 1;
  std::vector<int64_t> pos(cap, -1);
  const bool filter = filtering() || bloom();
  for (int64_t j = 0; j < n; ++j) {
    int64_t idx = FindIndex(s, keys[j], hashes[j]);
    if (idx < 0) {
      if (filter) continue;  // never admitted: the gradient is dropped
      idx = static_cast<int64_t>(InsertNew(s, keys[j], hashes[j], /*admit=*/true));
    }
    const Entry& e = s.entries[idx];
    if (e.row == kNoRow) continue;  // not admitted yet: dropped
    uint64_t p = HashKey(e.row) & (cap - 1);
    while (pos[p] >= 0 && hits[pos[p]].row != e.row) p = (p + 1) & (cap - 1);
    const float* g = grads + order[j] * dim_;
    if (pos[p] < 0) {
      pos[p] = static_cast<int64_t>(hits.size());
      hits.push_back(e);
      sums.insert(sums.end(), g, g + dim_);
    } else {
      float* acc = sums.data() + pos[p] * dim_;
      for (int64_t d = 0; d < dim_; ++d) acc[d] += g[d];
    }
  }
  std::vector<float*> slot_rows(slot_ids.size());
  for (size_t r = 0; r < hits.size(); ++r) {
    const Entry& e = hits[r];
    for (size_t j = 0; j < slot_ids.size(); ++j) {
      slot_rows[j] = s.slots[slot_ids[j]].Row(e.row);
    }
    fn(s.values.Row(e.row), slot_rows.data(), sums.data() + r * dim_);
    if (int64_t* m = Meta(s, e)) m[kVersion] = step;
  }
}

template <typename K>
template <typename Alloc>
void Table<K>::Export(Alloc&& alloc) const {
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(shards_.size());
  int64_t n = 0, nf = 0;
  for (const auto& s : shards_) {
    locks.emplace_back(s->mu);
    n += static_cast<int64_t>(s->live - s->filtered);
    nf += static_cast<int64_t>(s->filtered);
  }
  int64_t total_width = 0;
  for (const auto& spec : slot_specs_) total_width += spec.width;
  const std::optional<ExportBuffers> buffers = alloc(n, nf);
  if (!buffers) return;
  const ExportBuffers& b = *buffers;
  int64_t out = 0, out_f = 0;
  for (const auto& sp : shards_) {
    const Shard& s = *sp;
    for (uint64_t i = 0; i < s.ctrl.size(); ++i) {
      if (s.ctrl[i] & 0x80) continue;  // empty or deleted
      const Entry& e = s.entries[i];
      const int64_t* m = Meta(s, e);
      if (e.row == kNoRow) {
        b.keys_filtered[out_f] = e.key;
        b.freqs_filtered[out_f] = m ? m[kFreq] : 0;
        b.versions_filtered[out_f] = m ? m[kVersion] : 0;
        ++out_f;
        continue;
      }
      b.keys[out] = e.key;
      const float* v = s.values.Row(e.row);
      std::copy(v, v + dim_, b.values + out * dim_);
      b.freqs[out] = m ? m[kFreq] : 0;
      b.versions[out] = m ? m[kVersion] : 0;
      float* dst = b.slots + out * total_width;
      for (size_t j = 0; j < s.slots.size(); ++j) {
        const float* sv = s.slots[j].Row(e.row);
        std::copy(sv, sv + slot_specs_[j].width, dst);
        dst += slot_specs_[j].width;
      }
      ++out;
    }
  }
}

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_TABLE_H_
