// Copyright keras_rec_emb authors. Apache-2.0.
//
// The row store: the seam between the engine (index, filters, eviction) and
// where rows live. A row id names one admitted key's value row (dim floats)
// and its optimizer slot rows (one per slot, of the slot's width). Two
// implementations: DramRowStore (chunked arenas, everything in memory) and
// FileRowStore (file_store.h: a bounded DRAM cache over append-only segment
// files).
//
// Contract, per method (the engine keeps one store per shard, guarded by
// the shard's reader/writer lock):
//   Allocate     caller holds the lock exclusively. Returns a new row id
//                whose value is a copy of `init` and whose slots hold their
//                init values. May throw (bad_alloc, length_error, I/O
//                failure as std::runtime_error) and then changes nothing.
//   Release      exclusive lock. The id may be returned by a later
//                Allocate; its contents are gone (a file store counts its
//                bytes on file as garbage).
//   Value, Slot  exclusive lock unless stable_pointers(). A pointer to the
//                row, valid until the next call on this store that may
//                load another row (any Value/Slot/Allocate of another row)
//                when !stable_pointers(), else until Release/Clear. `write`
//                marks the row dirty: a file store writes it back before
//                dropping it from the cache. Value and Slot of one row are
//                valid together. A file store throws DataLossError when the
//                row's record is no longer on file as written (and I/O
//                errors as std::runtime_error); nothing changes then.
//   Prefetch     exclusive lock: a hint that the rows given are about to be
//                read (Value/Slot); a file store loads those it does not hold
//                in one pass, sorted by file offset, neighbours in one read.
//                Changes no row and throws nothing: a row it could not load
//                is read (and its error reported) by its Value call.
//   Read         a shared lock suffices (no state changes): copies the value
//                and the slots (concatenated) out. Does not fill a cache.
//                Throws as Value does.
//   ReserveSlot  exclusive lock; allocates what a new slot needs (may
//   CommitSlot   throw, changing nothing); CommitSlot then adds it and
//                cannot fail.
//   Sync         exclusive lock: makes every row durable (file store: dirty
//                rows written, files flushed). No-op for DRAM.
//   Clear        exclusive lock: drops every row.
// What survives a crash: nothing for DRAM; for a file store, the last
// snapshot (file_store.h).
#ifndef KRE_KV_ROW_STORE_H_
#define KRE_KV_ROW_STORE_H_

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "kv/arena.h"

namespace kre {
namespace kv {

// "No row": a key not admitted yet, or a cache slot without a row.
constexpr uint32_t kNoRow = UINT32_MAX;
// Row ids are below this: the two values under kNoRow mark a shard index's
// free slots (shard_index.h).
constexpr uint32_t kMaxRows = UINT32_MAX - 2;

// A store's files no longer hold what it wrote (a segment truncated or
// overwritten under the process, a record that fails its checksum): the
// rows on file are lost or suspect. The kernels report it as DataLoss,
// apart from exhausted resources and plain I/O errors.
class DataLossError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RowStoreStats {
  uint64_t rows = 0;          // rows held
  uint64_t cached_rows = 0;   // rows in DRAM
  uint64_t memory_bytes = 0;  // DRAM held for rows
  uint64_t disk_bytes = 0;    // bytes of files (live and garbage)
  uint64_t hits = 0;          // row accesses served from DRAM
  uint64_t misses = 0;        // row accesses that read the file
  uint64_t file_reads = 0;    // rows read from file
  uint64_t file_writes = 0;   // rows written to file

  RowStoreStats& operator+=(const RowStoreStats& o) {
    rows += o.rows;
    cached_rows += o.cached_rows;
    memory_bytes += o.memory_bytes;
    disk_bytes += o.disk_bytes;
    hits += o.hits;
    misses += o.misses;
    file_reads += o.file_reads;
    file_writes += o.file_writes;
    return *this;
  }
};

class RowStore {
 public:
  virtual ~RowStore() = default;
  virtual uint32_t Allocate(const float* init) = 0;
  virtual void Release(uint32_t row) = 0;
  virtual float* Value(uint32_t row, bool write) = 0;
  virtual float* Slot(size_t j, uint32_t row, bool write) = 0;
  virtual void Read(uint32_t row, float* value, float* slots) const = 0;
  virtual void Prefetch(const uint32_t* /*rows*/, size_t /*n*/) {}
  virtual void ReserveSlot(int64_t width, float init) = 0;
  virtual void CommitSlot() = 0;
  virtual void SetSlotInit(size_t j, float init) = 0;
  virtual void Sync() {}
  virtual void Clear() = 0;
  virtual bool stable_pointers() const = 0;
  virtual RowStoreStats Stats() const = 0;
};

// A row id from the free list, or the next new one (then *fresh is true and
// the storage must grow to hold it).
inline uint32_t TakeRow(std::vector<uint32_t>* free, uint32_t* next, bool* fresh) {
  *fresh = free->empty();
  if (!*fresh) {
    const uint32_t row = free->back();
    free->pop_back();
    return row;
  }
  if (*next >= kMaxRows) throw std::length_error("shard is full");
  return (*next)++;
}

// All rows in chunked arenas: values in one, each slot in a parallel one
// indexed by the same row id. Pointers are stable.
class DramRowStore final : public RowStore {
 public:
  explicit DramRowStore(int64_t dim) : dim_(dim), values_(dim) {}

  uint32_t Allocate(const float* init) override {
    bool fresh;
    const uint32_t row = TakeRow(&free_, &next_, &fresh);
    if (fresh) {
      try {
        values_.EnsureCapacity(next_, 0.0f);
        for (size_t j = 0; j < slots_.size(); ++j) slots_[j].EnsureCapacity(next_, inits_[j]);
      } catch (...) {
        --next_;  // out of memory: the row was not taken
        throw;
      }
    }
    std::copy(init, init + dim_, values_.Row(row));
    for (size_t j = 0; j < slots_.size(); ++j) {
      float* sv = slots_[j].Row(row);
      std::fill(sv, sv + slots_[j].width(), inits_[j]);
    }
    ++rows_;
    return row;
  }
  void Release(uint32_t row) override {
    free_.push_back(row);
    --rows_;
  }
  __attribute__((always_inline)) float* Value(uint32_t row, bool) override {
    return values_.Row(row);
  }
  float* Slot(size_t j, uint32_t row, bool) override { return slots_[j].Row(row); }
  void Read(uint32_t row, float* value, float* slots) const override {
    const float* v = values_.Row(row);
    std::copy(v, v + dim_, value);
    for (const auto& a : slots_) {
      const float* sv = a.Row(row);
      std::copy(sv, sv + a.width(), slots);
      slots += a.width();
    }
  }
  void ReserveSlot(int64_t width, float init) override {
    ChunkedArena<float> arena(width);
    arena.EnsureCapacity(next_, init);
    slots_.reserve(slots_.size() + 1);
    inits_.reserve(inits_.size() + 1);
    pending_ = std::move(arena);
    pending_init_ = init;
  }
  void CommitSlot() override {
    slots_.push_back(std::move(pending_));
    inits_.push_back(pending_init_);
    pending_ = ChunkedArena<float>();
  }
  void SetSlotInit(size_t j, float init) override { inits_[j] = init; }
  void Clear() override {
    values_.Clear();
    for (auto& a : slots_) a.Clear();
    next_ = 0;
    free_.clear();
    free_.shrink_to_fit();
    rows_ = 0;
  }
  bool stable_pointers() const override { return true; }
  // The value arena's chunk bases (ChunkedArena::RowIn with width dim):
  // valid until the next Allocate or Clear.
  float* const* value_bases() const { return values_.bases(); }
  RowStoreStats Stats() const override {
    RowStoreStats s;
    s.rows = s.cached_rows = rows_;
    s.memory_bytes = values_.BytesAllocated() + free_.capacity() * sizeof(uint32_t);
    for (const auto& a : slots_) s.memory_bytes += a.BytesAllocated();
    return s;
  }

 private:
  int64_t dim_;
  ChunkedArena<float> values_;
  std::vector<ChunkedArena<float>> slots_;
  std::vector<float> inits_;
  ChunkedArena<float> pending_;
  float pending_init_ = 0.0f;
  uint32_t next_ = 0;
  uint64_t rows_ = 0;
  std::vector<uint32_t> free_;
};

// Per-key metadata columns. kEpoch is the table's change epoch at the
// row's last change (see "Change tracking" in table.h).
enum MetaColumn { kFreq = 0, kVersion = 1, kEpoch = 2, kNumMeta = 3 };

// Metadata rows (frequency, version), kept in DRAM for every tier: the
// filters and eviction read them for every key.
class MetaRows {
 public:
  uint32_t Allocate() {
    bool fresh;
    const uint32_t row = TakeRow(&free_, &next_, &fresh);
    if (fresh) {
      try {
        arena_.EnsureCapacity(next_, 0);
      } catch (...) {
        --next_;  // out of memory: the row was not taken
        throw;
      }
    }
    int64_t* m = arena_.Row(row);
    m[kFreq] = 0;
    m[kVersion] = 0;
    m[kEpoch] = 0;
    return row;
  }
  void Release(uint32_t row) { free_.push_back(row); }
  int64_t* Row(uint32_t row) const { return arena_.Row(row); }
  void Clear() {
    arena_.Clear();
    next_ = 0;
    free_.clear();
    free_.shrink_to_fit();
  }
  uint64_t MemoryBytes() const {
    return arena_.BytesAllocated() + free_.capacity() * sizeof(uint32_t);
  }

 private:
  ChunkedArena<int64_t> arena_{kNumMeta};
  uint32_t next_ = 0;
  std::vector<uint32_t> free_;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_ROW_STORE_H_
