// Copyright keras_rec_emb authors. Apache-2.0.
//
// The embedding table: a collision-free hash map from integer keys to float
// rows of fixed width `dim`, free of TensorFlow. An engine with policies:
//
// * shard_index.h: the key space is split into shards by hash bits (hash.h
//   documents which bits pick the shard and the slot); each shard
//   has its own reader/writer lock and open-addressing index of {key,
//   value_row, meta_row or change epoch} entries.
// * row_store.h: the seam where rows live: values and parallel optimizer
//   slots by row id, in DRAM arenas (DramRowStore) or in a bounded DRAM
//   cache over segment files (file_store.h). Per-key metadata (frequency,
//   version) lives in DRAM metadata rows, only when tracked.
// * A new key k starts as a copy of default row (k mod default_value_dim) of
//   the [default_value_dim, dim] matrix given at construction (DeepRec's EV
//   Initializer).
// * counter_filter.h / bloom_filter.h: admission filters (DeepRec's feature
//   filter). With a counter filter a key seen fewer than `filter_freq` times
//   has an index entry and metadata but no value or slot rows; it reads
//   `no_permission_value` and its gradients are dropped. With a counting
//   Bloom filter, keys are counted in one counting Bloom filter of the whole
//   table and enter the index only once admitted. As in DeepRec, a key's
//   count before a training lookup decides what it reads: the lookup that
//   brings the count to the threshold admits the key (its row exists, so
//   this step's gradient trains it) but still reads no_permission_value,
//   and every occurrence of a key in one lookup reads the same value.
// * eviction.h: GlobalStepEvict and L2WeightEvict erase keys on demand.
// * shard_ops.h: helpers of the batched shard operations below.
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

#include "kv/bloom_filter.h"
#include "kv/counter_filter.h"
#include "kv/file_store.h"
#include "kv/hash.h"
#include "kv/row_store.h"
#include "kv/shard_index.h"
#include "kv/shard_ops.h"

namespace kre {
namespace kv {

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
  float no_permission_value = 0.0f;  // what keys not yet admitted read
  // Row storage: DRAM when storage_path is empty; otherwise the file tier
  // (file_store.h) under storage_path with a DRAM cache of about
  // cache_bytes for rows (split over shards). storage_lock = false is for a
  // staging table built beside a live table on the same path (an import).
  std::string storage_path;
  uint64_t cache_bytes = 64ull << 20;
  uint64_t segment_bytes = 64ull << 20;
  bool storage_lock = true;
  // > 0: a key's frequency stops growing at this count (DeepRec's default
  // with a filter: an admitted key reports `filter_freq` unless
  // TF_RECORD_FREQ=1); 0: every training-lookup occurrence counts.
  int64_t freq_cap = 0;
};

// Cumulative counters of a table (for statistics): key occurrences looked
// up, those that found an admitted row, keys admitted (rows created) and
// keys erased (eviction, Erase), since the table was made.
struct TableCounters {
  uint64_t lookups = 0;
  uint64_t hits = 0;
  uint64_t admitted = 0;
  uint64_t erased = 0;
};

struct SlotSpec {
  std::string name;
  int64_t width;
  float init;
};

template <typename K>
class Table {
 public:
  explicit Table(TableOptions options);
  // A table without filters that tracks metadata.
  Table(int64_t dim, std::vector<float> default_values, int num_shards);
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  static uint64_t Hash(K key) { return HashKey(static_cast<uint64_t>(static_cast<int64_t>(key))); }
  // Bits 24..55 of the hash scaled to [0, num_shards) by a multiply (any
  // shard count; apart from the slot bits (low)).
  int ShardOf(uint64_t h) const { return ShardOfHash(h, num_shards_); }
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
  bool bloom() const { return bloom_.enabled(); }

  // Number of admitted keys (those with rows).
  int64_t Size() const;
  // Number of keys counted by the counter filter but not admitted yet.
  int64_t FilteredSize() const;
  // The latest step stamped by Apply (the table's notion of "now"); -1
  // before any. A training lookup belongs to the step after it.
  int64_t LatestStep() const { return latest_step_.load(std::memory_order_relaxed); }
  // Bytes held by index, arenas and free lists.
  uint64_t MemoryBytes() const;
  // The row stores' counters, summed over shards.
  RowStoreStats StoreStats() const;

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
  int64_t Lookup(int shard, const K* keys, const uint64_t* hashes, const int64_t* order, int64_t n,
                 bool insert, float* out);
  // Lookup of distinct keys, keys[j] standing for counts[order[j]] >= 1
  // occurrences in a batch: the table ends as if the batch had been looked
  // up by Lookup, and every occurrence reads what Lookup gives it (every
  // occurrence of a key reads the same row).
  int64_t LookupCounted(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                        const int32_t* counts, int64_t n, bool insert, float* out);
  // Whether LookupOrdered serves this table: rows in DRAM, no admission
  // filter.
  bool OrderedLookups() const { return !file_tier() && !filtering() && !bloom(); }
  // Whether a lookup of n keys is faster through LookupOrdered than shard by
  // shard: it locks every shard, so it pays from kMinOrderedIdsPerShard ids
  // per shard on, and a larger table than kMaxOrderedKeys is faster shard by
  // shard (its random walk over every shard's memory misses the TLB; the
  // lookup A/B that measured it, benchmarks/kv_ab/run.sh, is in the history
  // before a405d41). Callers split such a lookup into
  // blocks of kOrderedBlock keys over their threads.
  static constexpr int64_t kMinOrderedIdsPerShard = 4;
  static constexpr int64_t kMaxOrderedKeys = 1 << 16;
  static constexpr int64_t kOrderedBlock = 2048;
  bool PrefersOrderedLookup(int64_t n) const {
    return OrderedLookups() && n >= kMinOrderedIdsPerShard * num_shards() &&
           Size() <= kMaxOrderedKeys;
  }
  // Looks up keys[0..n) in batch order, no partition by shard needed: the
  // row of keys[i] goes to out + i * stride (stride >= dim floats). The
  // table ends as after Partition + Lookup of every shard, and every key
  // reads what Lookup gives it, but a training lookup is not one step per
  // shard: keys present are read (and their frequencies counted, atomically)
  // with every shard locked shared, so concurrent lookups of a table do not
  // wait on each other, and missing keys are then inserted shard by shard
  // under the exclusive lock. Requires OrderedLookups(). Returns the number
  // of keys inserted. Locks every shard: for batches of at least a few keys
  // per shard.
  int64_t LookupOrdered(const K* keys, int64_t n, bool insert, float* out, int64_t stride);

  // An inference read in batch order that hands out row pointers instead
  // of copies: it locks every shard shared for its lifetime, Find()s rows
  // while it lives, and adds its lookup counts to the table's when it is
  // destroyed. The rows stay valid and unchanged while it lives (writers
  // wait for it), so a caller can combine them straight from the table
  // instead of copying them into a buffer first (the row loads come after
  // a whole block of index probes, not a few keys behind them).
  // Requires OrderedLookups(). Readers of one table do not wait on each
  // other; a thread must not hold one while it writes to the same table.
  class OrderedReader {
   public:
    explicit OrderedReader(Table& table);
    ~OrderedReader();
    OrderedReader(const OrderedReader&) = delete;
    OrderedReader& operator=(const OrderedReader&) = delete;
    // rows[i] = the row of keys[i] (dim() floats): its value row when
    // admitted, else its default row (as LookupOrdered without insert).
    // Each row found is prefetched: into L2 when `read_later` (the caller
    // reads the rows after a block too large for L1 to keep them), else
    // into L1.
    void Find(const K* keys, int64_t n, const float** rows, bool read_later = false);

   private:
    template <bool kReadLater>
    void FindImpl(const K* keys, int64_t n, const float** rows);
    // What Find reads of a shard, gathered in one small array when the
    // reader is made (valid while it holds the locks): the index's entries
    // and mask and the value arena's chunk bases, so that a key's row is
    // found with no loads of the shard, its store or its arena on the way.
    struct ShardView {
      const typename ShardIndex<K>::Entry* entries;
      uint64_t mask;
      float* const* bases;
      uint64_t reach;  // ShardIndex::reach()
    };
    Table& table_;
    std::vector<std::shared_lock<std::shared_mutex>> locks_;
    std::vector<ShardView> views_;
    // Occurrences looked up, and those of them that read a default row
    // (not admitted), added to the table's counters when the reader is
    // destroyed (see CountLookups).
    uint64_t lookups_ = 0;
    uint64_t defaults_ = 0;
  };
  // What keys not yet admitted read: dim() copies of no_permission_value.
  const float* NoPermissionRow() const { return no_permission_row_.data(); }

  // Sums the gradient rows (grads + order[j] * dim) of equal keys among
  // keys[0..n) (all in shard `shard`, with their hashes), and for each
  // distinct admitted key stamps its version with `step` and calls
  // fn(value_row, slot_rows, grad_sum) with slot_rows[j] the row of slot
  // slot_ids[j]. Missing keys are inserted first when no filter is on; with
  // a filter, gradients of keys not admitted are dropped.
  template <typename Fn>
  void Apply(int shard, const K* keys, const uint64_t* hashes, const int64_t* order, int64_t n,
             const float* grads, const std::vector<int>& slot_ids, int64_t step, Fn&& fn);

  // Apply for keys[0..n) known to be distinct (the group lookup's backward
  // yields one summed gradient row per distinct key): the same updates,
  // versions and insertions as Apply, without its dedupe and gradient copy,
  // and pipelined (index slots, then value, slot and metadata rows are
  // prefetched some keys ahead) when the rows live in DRAM. Equal keys among
  // keys[] would each be applied once, in order: callers must not pass them.
  template <typename Fn>
  void ApplyDistinct(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                     int64_t n, const float* grads, const std::vector<int>& slot_ids, int64_t step,
                     Fn&& fn);

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
  // The Bloom counters (empty without a Bloom filter).
  std::vector<uint8_t> BloomState() const;
  // The size of BloomState(), and BloomState() written to `dst` (that many
  // bytes) without building it in memory on the way.
  size_t BloomStateBytes() const { return bloom_.StateBytes(); }
  void CopyBloomState(uint8_t* dst) const;
  // Restores them if `state` has this table's size; returns whether it did.
  bool SetBloomState(const std::vector<uint8_t>& state) {
    return SetBloomState(state.data(), state.size());
  }
  bool SetBloomState(const uint8_t* state, size_t size);
  // The estimated count of `key` in the Bloom filter (0 without one).
  uint64_t BloomCount(K key) const;

  // Inserts or overwrites n rows. `slot_ids[j]` names the table slot that
  // column block j of `slots` ([n, sum(widths)]) holds; `slot_widths[j]` its
  // width. freqs/versions may be null (then zero); a negative freqs[i]
  // keeps the frequency of a key already present (0 for a new one).
  void Import(const K* keys, const float* values, const int64_t* freqs, const int64_t* versions,
              int64_t n, const float* slots, const std::vector<int>& slot_ids,
              const std::vector<int64_t>& slot_widths);
  // Inserts keys counted but not admitted, with their counts; a key that is
  // already admitted stays admitted. They are admitted by the lookup that
  // brings their count to the (current) threshold.
  void ImportFiltered(const K* keys, const int64_t* freqs, const int64_t* versions, int64_t n);

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
  bool Find(K key, std::vector<float>* value, int64_t* freq, int64_t* version) const;

  // File tier only (see file_store.h). Snapshot writes a consistent
  // snapshot of the table under storage_path and returns its sequence
  // number; RestoreSnapshot replaces the contents with the latest snapshot
  // under `path` (storage_path when empty) and returns the number of keys.
  // Both throw std::runtime_error naming the file on I/O errors or a
  // corrupt or truncated snapshot; a failed restore leaves the table as it
  // was (every file is checked first, the new contents built aside).
  bool file_tier() const { return !options_.storage_path.empty(); }

  // --- Change tracking (incremental checkpoints, serving deltas) ---------
  // Every change of a key's state (row created, value or slot updated,
  // frequency or version changed, imported) stamps the key with the
  // table's current change epoch; erased keys are logged with the epoch of
  // their erasure once tracking is on (after the first MarkChanges).
  //
  // Closes the current epoch and returns it as a mark M: changes from now
  // on carry epochs > M. Takes every shard lock exclusively (so no change
  // in flight straddles the mark) and turns on the log of erased keys.
  int64_t MarkChanges();
  // The current (open) change epoch.
  int64_t ChangeEpoch() const { return epoch_.load(std::memory_order_relaxed); }
  // Exports, as Export does, only the keys changed after mark `since`
  // (admitted and counted-but-not-admitted), and appends to *erased the keys
  // erased after it (a key erased and re-inserted is in both: replay erases
  // first, then imports). One consistent view, every shard locked shared.
  // Returns false when the contents were replaced wholesale (Clear,
  // SwapContents, RestoreSnapshot) after `since`: the changes cannot be
  // expressed as a delta and a full export is needed.
  template <typename Alloc>
  bool ExportChangedSince(int64_t since, Alloc&& alloc, std::vector<K>* erased) const;
  // Forgets logged erasures at or before mark `upto` (once a delta that
  // holds them is safely stored).
  void TrimErasedLog(int64_t upto);
  // Entries in the erased-keys log.
  int64_t ErasedLogSize() const;
  // Cumulative counters (see TableCounters).
  TableCounters Counters() const;
  int64_t Snapshot();
  // Releases storage_path's lock (the owner of this table has let go of it
  // and another table may take the path); the table keeps working on its
  // open files but must not snapshot any more.
  void ReleaseStorageLock();
  int64_t RestoreSnapshot(const std::string& path);

 private:
  using Index = ShardIndex<K>;
  using Entry = typename Index::Entry;
  // The load limit of this table's shard indexes: a file tier's index is
  // most of its DRAM per key, so it runs fuller (see ShardIndex::MaxLoad).
  typename Index::MaxLoad IndexMaxLoad() const {
    return file_tier() ? Index::kCompactMaxLoad : Index::kMaxLoad;
  }

  struct Shard {
    mutable std::shared_mutex mu;
    Index index;
    std::unique_ptr<RowStore> store;
    DramRowStore* dram = nullptr;  // store, when it is the DRAM one
    MetaRows meta;
    uint64_t filtered = 0;  // entries not admitted
    // Change tracking: the keys erased with the epoch of their erasure (a
    // key's own epoch is the metadata's kEpoch column, or the index entry's
    // aux field when metadata is not tracked).
    std::vector<std::pair<K, int64_t>> erased_log;
    // Counters (see TableCounters); lookups and hits are added once per
    // batch, also under a shared lock.
    std::atomic<uint64_t> lookups{0};
    std::atomic<uint64_t> hits{0};
    uint64_t admitted_total = 0;  // under the exclusive lock
    uint64_t erased_total = 0;    // under the exclusive lock

    // The row of an admitted entry (DramRowStore is final: inlined).
    __attribute__((always_inline)) float* Value(uint32_t row, bool write) {
      return dram ? dram->Value(row, write) : store->Value(row, write);
    }
    void SwapContents(Shard& o) {
      index.Swap(o.index);
      store.swap(o.store);
      std::swap(dram, o.dram);
      std::swap(meta, o.meta);
      std::swap(filtered, o.filtered);
      std::swap(erased_log, o.erased_log);
    }
    // Empties the shard (index, rows, metadata, change log).
    void Reset() {
      index.Clear();
      store->Clear();
      meta.Clear();
      filtered = 0;
      erased_log.clear();
      erased_log.shrink_to_fit();
    }
  };

  int64_t* Meta(const Shard& s, const Entry& e) const {
    return !options_.track_meta || e.aux == kNoRow ? nullptr : s.meta.Row(e.aux);
  }
  // The aux field of a new entry: a new metadata row (stamped with the
  // current epoch) or the current epoch.
  uint32_t NewAux(Shard& s) {
    if (!options_.track_meta) return EpochWord();
    const uint32_t meta_row = s.meta.Allocate();
    s.meta.Row(meta_row)[kEpoch] = epoch_.load(std::memory_order_relaxed);
    return meta_row;
  }
  // The current epoch as stored in an entry (saturating at 2^32 - 2: four
  // billion MarkChanges calls).
  uint32_t EpochWord() const {
    return static_cast<uint32_t>(
        std::min<int64_t>(epoch_.load(std::memory_order_relaxed), UINT32_MAX - 1));
  }
  // Inserts a missing key; with `admit` it gets value and slot rows. Returns
  // its index position.
  uint64_t InsertNew(Shard& s, K key, uint64_t h, bool admit);
  // The entry a gradient of `key` (hash h) updates, inserting the key when no
  // filter is on; nullptr when the gradient is dropped (the key is not
  // admitted). The pointer is valid until the next insert into the shard.
  Entry* AppliedEntry(Shard& s, K key, uint64_t h, bool filter);
  // Gives entry i its value and slot rows, initialized for its key.
  uint32_t Admit(Shard& s, uint64_t i);
  // The frequency after `count` more occurrences (saturating, and at most
  // options_.freq_cap when that is > 0).
  int64_t CountFreq(int64_t freq, int64_t count) const;
  // Change tracking: stamps index entry e with the current epoch (caller
  // holds the shard exclusively; e is the entry in the index, not a copy),
  // and reads its epoch.
  void Touch(Shard& s, Entry& e) {
    if (!options_.track_meta) {
      e.aux = EpochWord();
    } else if (e.aux != kNoRow) {
      s.meta.Row(e.aux)[kEpoch] = epoch_.load(std::memory_order_relaxed);
    }
  }
  int64_t EpochOf(const Shard& s, const Entry& e) const {
    if (!options_.track_meta) return e.aux;
    return e.aux == kNoRow ? 0 : LoadRelaxed(s.meta.Row(e.aux) + kEpoch);
  }
  // Adds one batch's lookup counts to the shard's counters. The shards'
  // counters are only read summed (Counters()), so a batched lookup may add
  // all its counts to one shard instead of two increments per key in the
  // lookup loops.
  void CountLookups(Shard& s, uint64_t occurrences, uint64_t hits);
  // One key's row for Lookup (see there); counts admissions in *admitted
  // and occurrences that found an admitted row in *hits.
  const float* Resolve(Shard& s, K key, uint64_t h, bool insert, int64_t now, int64_t count,
                       int64_t* admitted, uint64_t* hits);
  // A store without stable pointers (the file tier) gets the rows of the
  // keys of a lookup that are in the index, to load as a batch
  // (RowStore::Prefetch); caller holds the shard's lock exclusively.
  void PrefetchRows(Shard& s, const K* keys, const uint64_t* hashes, int64_t n);
  template <bool kCounted>
  int64_t LookupImpl(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                     const int32_t* counts, int64_t n, bool insert, float* out);
  // LookupImpl's path for a DRAM store without filters (caller holds the
  // shard lock): a software pipeline over the keys.
  template <bool kCounted>
  void LookupPipelined(Shard& s, const K* keys, const uint64_t* hashes, const int64_t* order,
                       const int32_t* counts, int64_t n, bool insert, int64_t now, float* out,
                       int64_t* inserted, uint64_t* hits, uint64_t* occurrences);
  void EraseAt(Shard& s, uint64_t i);
  // The export pass of Export and ExportChangedSince (caller holds every
  // shard lock): writes each entry for which keep(shard, entry) holds into
  // `b`, admitted keys and counted-but-not-admitted ones apart, in shard
  // and slot order; `b` has room for exactly those entries.
  template <typename Keep>
  void WriteEntries(const ExportBuffers& b, Keep&& keep) const;
  // Calls fn(shard, entry) for every key of every shard, in shard and slot
  // order (the caller holds every shard lock).
  template <typename Fn>
  void ForEachEntry(Fn&& fn) const {
    for (const auto& sp : shards_) {
      for (uint64_t i = 0; i < sp->index.capacity(); ++i) {
        if (sp->index.Occupied(i)) fn(*sp, sp->index.entry(i));
      }
    }
  }
  // The walk of Import and ImportFiltered: with every shard locked
  // exclusively, calls fn(i, shard, hash, idx) for each of keys[0 .. n),
  // idx being the key's index position in its shard (-1 when absent).
  template <typename Fn>
  void ForEachKeyLocked(const K* keys, int64_t n, Fn&& fn) {
    std::vector<std::unique_lock<std::shared_mutex>> locks;
    LockAll(&locks);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t h = Hash(keys[i]);
      Shard& s = *shards_[ShardOf(h)];
      fn(i, s, h, s.index.Find(keys[i], h));
    }
  }
  // Calls fn(shard) for every shard under its shared lock, one shard at a
  // time (the totals of Size, Counters, ... are not one instant's).
  template <typename Fn>
  void ForEachShardShared(Fn&& fn) const {
    for (const auto& sp : shards_) {
      std::shared_lock<std::shared_mutex> lock(sp->mu);
      fn(static_cast<const Shard&>(*sp));
    }
  }
  void RaiseLatestStep(int64_t step);
  std::unique_ptr<RowStore> NewStore(int shard) const;
  void LockAll(std::vector<std::unique_lock<std::shared_mutex>>* locks) const;

  const TableOptions options_;
  const int64_t dim_;
  // Read under any shard lock, replaced with every shard locked.
  std::vector<float> default_values_;
  int64_t default_value_dim_;
  uint64_t num_shards_;
  std::unique_ptr<StorageLock> storage_lock_;
  std::shared_ptr<FileSpace> space_;
  CountingBloomFilter bloom_;
  CounterFilter filter_;
  std::vector<float> no_permission_row_;
  std::atomic<int64_t> latest_step_{-1};
  std::vector<std::unique_ptr<Shard>> shards_;
  // Changed only with every shard locked exclusively, so holding any shard
  // lock gives a consistent view.
  std::vector<SlotSpec> slot_specs_;
  mutable std::mutex slot_specs_mu_;  // for readers that hold no shard lock
  // Change tracking: the open epoch, whether erasures are logged, and the
  // epoch at which the contents were last replaced wholesale (changed
  // with every shard locked exclusively).
  std::atomic<int64_t> epoch_{1};
  std::atomic<bool> log_erased_{false};
  int64_t reset_epoch_ = 0;
};

// ---------------------------------------------------------------------------
// Template members used by kernels with their own functors.

template <typename K>
typename Table<K>::Entry* Table<K>::AppliedEntry(Shard& s, K key, uint64_t h, bool filter) {
  int64_t idx = s.index.Find(key, h);
  if (idx < 0) {
    if (filter) return nullptr;  // never admitted
    idx = static_cast<int64_t>(InsertNew(s, key, h, /*admit=*/true));
  }
  Entry& e = s.index.entry(idx);
  return e.row == kNoRow ? nullptr : &e;  // kNoRow: not admitted yet
}

template <typename K>
template <typename Fn>
void Table<K>::Apply(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                     int64_t n, const float* grads, const std::vector<int>& slot_ids, int64_t step,
                     Fn&& fn) {
  RaiseLatestStep(step);
  Shard& s = *shards_[shard];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  // Distinct admitted keys in first-seen order with their summed gradient.
  // Row ids (stable while inserts rehash the index) identify them.
  std::vector<Entry> hits;
  std::vector<float> sums;
  hits.reserve(n);
  sums.reserve(n * dim_);
  BatchGroups groups(n);
  const bool filter = filtering() || bloom();
  for (int64_t j = 0; j < n; ++j) {
    Entry* found = AppliedEntry(s, keys[j], hashes[j], filter);
    if (found == nullptr) continue;  // not admitted: the gradient is dropped
    Entry& e = *found;
    Touch(s, e);  // (the entry in the index; `hits` holds copies)
    bool created;
    const int64_t g = groups.Group(
        HashKey(e.row), [&](int64_t other) { return hits[other].row == e.row; }, &created);
    const float* grad = grads + order[j] * dim_;
    if (created) {
      hits.push_back(e);
      sums.insert(sums.end(), grad, grad + dim_);
    } else {
      float* acc = sums.data() + g * dim_;
      for (int64_t d = 0; d < dim_; ++d) acc[d] += grad[d];
    }
  }
  std::vector<float*> slot_rows(slot_ids.size());
  for (size_t r = 0; r < hits.size(); ++r) {
    const Entry& e = hits[r];
    // Value first: a file store loads the row's record, then its slots
    // come from the same record.
    float* value = s.Value(e.row, /*write=*/true);
    for (size_t j = 0; j < slot_ids.size(); ++j) {
      slot_rows[j] = s.store->Slot(slot_ids[j], e.row, /*write=*/true);
    }
    fn(value, slot_rows.data(), sums.data() + r * dim_);
    if (int64_t* m = Meta(s, e)) m[kVersion] = step;
  }
}

template <typename K>
template <typename Fn>
void Table<K>::ApplyDistinct(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                             int64_t n, const float* grads, const std::vector<int>& slot_ids,
                             int64_t step, Fn&& fn) {
  Shard& s = *shards_[shard];
  if (s.dram == nullptr) {  // a file store: rows move as they load; the plain path
    Apply(shard, keys, hashes, order, n, grads, slot_ids, step, std::forward<Fn>(fn));
    return;
  }
  RaiseLatestStep(step);
  std::unique_lock<std::shared_mutex> lock(s.mu);
  // Stage 1 prefetches key j + kSlotAhead's index slot; stage 2 finds key j
  // (inserting it when no filter is on), stamps its epoch when metadata is
  // not tracked (the entry is in cache) and prefetches its rows; stage 3
  // updates key j - kRowAhead. Only row and metadata pointers cross stages
  // (an insert may rehash the index; DRAM rows and metadata rows stay put).
  constexpr int64_t kSlotAhead = 24;
  constexpr int64_t kRowAhead = 16;
  static_assert(IsPowerOfTwo(kRowAhead), "ring slots are j & (kRowAhead - 1)");
  constexpr int kMaxSlots = 8;
  const size_t num_slots = slot_ids.size();
  if (num_slots > static_cast<size_t>(kMaxSlots)) {
    Apply(shard, keys, hashes, order, n, grads, slot_ids, step, std::forward<Fn>(fn));
    return;
  }
  struct Pending {
    float* value;
    float* slots[kMaxSlots];
    int64_t* meta;
    const float* grad;
  };
  Pending ring[kRowAhead];
  bool live[kRowAhead] = {};
  const bool filter = filtering() || bloom();
  const int64_t epoch = epoch_.load(std::memory_order_relaxed);
  const bool indexed = !s.index.empty_storage();
  auto prefetch_slot = [&](int64_t j) { s.index.PrefetchProbe(hashes[j]); };
  if (indexed) {
    for (int64_t j = 0; j < std::min(n, kSlotAhead); ++j) prefetch_slot(j);
  }
  for (int64_t j = 0; j < n + kRowAhead; ++j) {
    const int64_t r = j & (kRowAhead - 1);
    if (j >= kRowAhead && live[r]) {  // stage 3 for key j - kRowAhead
      Pending& q = ring[r];
      fn(q.value, q.slots, q.grad);
      if (q.meta != nullptr) {
        q.meta[kEpoch] = epoch;
        q.meta[kVersion] = step;
      }
    }
    live[r] = false;
    if (j >= n) continue;
    if (indexed && j + kSlotAhead < n) prefetch_slot(j + kSlotAhead);
    Entry* found = AppliedEntry(s, keys[j], hashes[j], filter);
    if (found == nullptr) continue;  // not admitted: the gradient is dropped
    Entry& e = *found;
    Pending& q = ring[r];
    q.meta = Meta(s, e);
    if (!options_.track_meta) Touch(s, e);  // writes the entry itself
    q.value = s.dram->Value(e.row, /*write=*/true);
    for (int64_t d = 0; d < dim_; d += 16) __builtin_prefetch(q.value + d, 1);
    for (size_t k = 0; k < num_slots; ++k) {
      q.slots[k] = s.dram->Slot(slot_ids[k], e.row, /*write=*/true);
      __builtin_prefetch(q.slots[k], 1);
    }
    if (q.meta != nullptr) __builtin_prefetch(q.meta, 1);
    q.grad = grads + order[j] * dim_;
    for (int64_t d = 0; d < dim_; d += 16) __builtin_prefetch(q.grad + d);
    live[r] = true;
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
    n += static_cast<int64_t>(s->index.live() - s->filtered);
    nf += static_cast<int64_t>(s->filtered);
  }
  const std::optional<ExportBuffers> buffers = alloc(n, nf);
  if (!buffers) return;
  WriteEntries(*buffers, [](const Shard&, const Entry&) { return true; });
}

template <typename K>
template <typename Alloc>
bool Table<K>::ExportChangedSince(int64_t since, Alloc&& alloc, std::vector<K>* erased) const {
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(shards_.size());
  for (const auto& s : shards_) locks.emplace_back(s->mu);
  const bool complete = since >= reset_epoch_;
  int64_t n = 0, nf = 0;
  ForEachEntry([&](const Shard& s, const Entry& e) {
    if (EpochOf(s, e) > since) ++(e.row == kNoRow ? nf : n);
  });
  for (const auto& s : shards_) {
    for (const auto& ke : s->erased_log) {
      if (ke.second > since) erased->push_back(ke.first);
    }
  }
  const std::optional<ExportBuffers> buffers = alloc(n, nf);
  if (!buffers) return complete;
  WriteEntries(*buffers, [&](const Shard& s, const Entry& e) { return EpochOf(s, e) > since; });
  return complete;
}

template <typename K>
template <typename Keep>
void Table<K>::WriteEntries(const ExportBuffers& b, Keep&& keep) const {
  int64_t total_width = 0;
  for (const auto& spec : slot_specs_) total_width += spec.width;
  int64_t out = 0, out_f = 0;
  ForEachEntry([&](const Shard& s, const Entry& e) {
    if (!keep(s, e)) return;
    const int64_t* m = Meta(s, e);
    if (e.row == kNoRow) {
      b.keys_filtered[out_f] = e.key;
      b.freqs_filtered[out_f] = m ? LoadRelaxed(m + kFreq) : 0;
      b.versions_filtered[out_f] = m ? m[kVersion] : 0;
      ++out_f;
      return;
    }
    b.keys[out] = e.key;
    s.store->Read(e.row, b.values + out * dim_, b.slots + out * total_width);
    b.freqs[out] = m ? LoadRelaxed(m + kFreq) : 0;
    b.versions[out] = m ? m[kVersion] : 0;
    ++out;
  });
}

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_TABLE_H_
