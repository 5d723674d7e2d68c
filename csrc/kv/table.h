// Copyright keras_rec_emb authors. Apache-2.0.
//
// The embedding table: a collision-free hash map from integer keys to float
// rows of fixed width `dim`, free of TensorFlow.
//
// * The key space is split into shards by hash bits; each shard has its own
//   reader/writer lock, open-addressing index (one control byte per slot kept
//   apart from the {key, row} entries, linear probing, power-of-two capacity,
//   load factor <= 0.75 with tombstones counted) and its own arenas.
// * Rows live in chunked arenas that never move; optimizer slots live in
//   parallel arenas indexed by the same row id, as does the per-row metadata
//   (frequency, version = last-update step). Erased rows go to a free list.
// * A new key k starts as a copy of default row (k mod default_value_dim) of
//   the [default_value_dim, dim] matrix given at construction (DeepRec's EV
//   Initializer).
//
// Batched operations take the keys of one shard with their hashes and their
// positions in the batch (see Partition in partition.h) and lock that shard
// once.
#ifndef KRE_KV_TABLE_H_
#define KRE_KV_TABLE_H_

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
  // `default_values` is row-major [default_value_dim, dim].
  // `num_shards` must be a power of two in [1, 65536].
  Table(int64_t dim, std::vector<float> default_values, int num_shards);
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  static uint64_t Hash(K key) {
    return HashKey(static_cast<uint64_t>(static_cast<int64_t>(key)));
  }
  int ShardOf(uint64_t h) const { return static_cast<int>((h >> 40) & shard_mask_); }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  int64_t dim() const { return dim_; }
  int64_t default_value_dim() const { return default_value_dim_; }

  // The EV-initializer row of `key`.
  const float* DefaultRow(K key) const;
  // The EV-initializer matrix [default_value_dim, dim], row-major.
  std::vector<float> DefaultValues() const;
  // Replaces it (rows added from now on use the new matrix).
  void SetDefaultValues(std::vector<float> default_values);

  // Number of keys.
  int64_t Size() const;
  // Bytes held by index, arenas and free lists.
  uint64_t MemoryBytes() const;

  // Looks up keys[0..n) (all in shard `shard`, with their hashes), writing
  // the row of keys[j] to out + order[j] * dim. With `insert`, missing keys
  // are inserted with their default row and every occurrence increments the
  // key's frequency; without, missing keys read their default row and
  // nothing changes. Returns the number of keys inserted.
  int64_t Lookup(int shard, const K* keys, const uint64_t* hashes,
                 const int64_t* order, int64_t n, bool insert, float* out);

  // Sums the gradient rows (grads + order[j] * dim) of equal keys among
  // keys[0..n) (all in shard `shard`, with their hashes), finds or inserts
  // each distinct key, stamps its version with `step`, and calls
  // fn(value_row, slot_rows, grad_sum) once per distinct key with
  // slot_rows[j] the row of slot slot_ids[j].
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

  // Exports every row. `alloc(n)` is called once, with every shard locked,
  // and returns buffers for n rows: keys[n], values[n, dim], freqs[n],
  // versions[n], slots[n, total_slot_width] (slot columns in slot order), or
  // std::nullopt to abandon the export.
  struct ExportBuffers {
    K* keys;
    float* values;
    int64_t* freqs;
    int64_t* versions;
    float* slots;
  };
  template <typename Alloc>
  void Export(Alloc&& alloc) const;

  // Inserts or overwrites n rows. `slot_ids[j]` names the table slot that
  // column block j of `slots` ([n, sum(widths)]) holds; `slot_widths[j]` its
  // width. freqs/versions may be null (then zero).
  void Import(const K* keys, const float* values, const int64_t* freqs,
              const int64_t* versions, int64_t n, const float* slots,
              const std::vector<int>& slot_ids,
              const std::vector<int64_t>& slot_widths);

  bool Erase(K key);
  void Clear();
  // Reads one row (value and meta) if present, for tests and tools.
  bool Find(K key, std::vector<float>* value, int64_t* freq,
            int64_t* version) const;

 private:
  static constexpr uint8_t kEmpty = 0x80;
  static constexpr uint8_t kDeleted = 0xFE;
  static constexpr uint64_t kMinCapacity = 16;

  struct Entry {
    K key;
    uint32_t row;
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
    ChunkedArena<int64_t> meta{kNumMeta};
    uint32_t next_row = 0;
    std::vector<uint32_t> free_rows;
  };

  static uint8_t Tag(uint64_t h) { return static_cast<uint8_t>(h >> 57); }
  int64_t FindIndex(const Shard& s, K key, uint64_t h) const;
  uint32_t InsertNew(Shard& s, K key, uint64_t h);
  void Rehash(Shard& s, uint64_t new_capacity);
  void EraseAt(Shard& s, uint64_t i);
  void ResetShard(Shard& s);

  const int64_t dim_;
  // Read under any shard lock, replaced with every shard locked.
  std::vector<float> default_values_;
  int64_t default_value_dim_;
  uint64_t shard_mask_;
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
  Shard& s = *shards_[shard];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  // Distinct rows in first-seen order with their summed gradient. A small
  // open-addressing map from row id to position dedupes equal keys.
  std::vector<uint32_t> rows;
  std::vector<float> sums;
  rows.reserve(n);
  sums.reserve(n * dim_);
  uint64_t cap = 16;
  while (cap < static_cast<uint64_t>(n) * 2) cap <<= 1;
  std::vector<int64_t> pos(cap, -1);
  for (int64_t j = 0; j < n; ++j) {
    int64_t idx = FindIndex(s, keys[j], hashes[j]);
    const uint32_t row =
        idx >= 0 ? s.entries[idx].row : InsertNew(s, keys[j], hashes[j]);
    uint64_t p = HashKey(row) & (cap - 1);
    while (pos[p] >= 0 && rows[pos[p]] != row) p = (p + 1) & (cap - 1);
    const float* g = grads + order[j] * dim_;
    if (pos[p] < 0) {
      pos[p] = static_cast<int64_t>(rows.size());
      rows.push_back(row);
      sums.insert(sums.end(), g, g + dim_);
    } else {
      float* acc = sums.data() + pos[p] * dim_;
      for (int64_t d = 0; d < dim_; ++d) acc[d] += g[d];
    }
  }
  std::vector<float*> slot_rows(slot_ids.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const uint32_t row = rows[r];
    for (size_t j = 0; j < slot_ids.size(); ++j) {
      slot_rows[j] = s.slots[slot_ids[j]].Row(row);
    }
    fn(s.values.Row(row), slot_rows.data(), sums.data() + r * dim_);
    s.meta.Row(row)[kVersion] = step;
  }
}

template <typename K>
template <typename Alloc>
void Table<K>::Export(Alloc&& alloc) const {
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(shards_.size());
  int64_t n = 0;
  for (const auto& s : shards_) {
    locks.emplace_back(s->mu);
    n += static_cast<int64_t>(s->live);
  }
  int64_t total_width = 0;
  for (const auto& spec : slot_specs_) total_width += spec.width;
  const std::optional<ExportBuffers> buffers = alloc(n);
  if (!buffers) return;
  const ExportBuffers& b = *buffers;
  int64_t out = 0;
  for (const auto& sp : shards_) {
    const Shard& s = *sp;
    for (uint64_t i = 0; i < s.ctrl.size(); ++i) {
      if (s.ctrl[i] & 0x80) continue;  // empty or deleted
      const uint32_t row = s.entries[i].row;
      b.keys[out] = s.entries[i].key;
      const float* v = s.values.Row(row);
      std::copy(v, v + dim_, b.values + out * dim_);
      const int64_t* m = s.meta.Row(row);
      b.freqs[out] = m[kFreq];
      b.versions[out] = m[kVersion];
      float* dst = b.slots + out * total_width;
      for (size_t j = 0; j < s.slots.size(); ++j) {
        const float* sv = s.slots[j].Row(row);
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
