// Copyright keras_rec_emb authors. Apache-2.0.
// The engine: shards of (index, row store, metadata) under one lock each,
// with the filter, eviction and import/export policies on top.
#include "kv/table.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kv/eviction.h"

namespace kre {
namespace kv {

namespace {

TableOptions Validated(TableOptions o) {
  if (o.dim <= 0) throw std::invalid_argument("dim must be positive");
  const int64_t rows = static_cast<int64_t>(o.default_values.size()) / o.dim;
  if (rows <= 0 || rows * o.dim != static_cast<int64_t>(o.default_values.size())) {
    throw std::invalid_argument(
        "default_values must hold default_value_dim >= 1 rows of dim floats");
  }
  if (o.num_shards < 1 || o.num_shards > 65536) {
    throw std::invalid_argument("num_shards must be in [1, 65536]");
  }
  if (o.bloom_counters > 0) {
    const int b = o.bloom_counter_bytes;
    if (b != 1 && b != 2 && b != 4 && b != 8) {
      throw std::invalid_argument("bloom_counter_bytes must be 1, 2, 4 or 8");
    }
    if (o.bloom_hashes < 1) throw std::invalid_argument("bloom_hashes must be >= 1");
  } else if (o.filter_freq > 1) {
    o.track_meta = true;  // the counter filter counts in the metadata
  }
  return o;
}

}  // namespace

template <typename K>
Table<K>::Table(int64_t dim, std::vector<float> default_values, int num_shards)
    : Table([&] {
        TableOptions o;
        o.dim = dim;
        o.default_values = std::move(default_values);
        o.num_shards = num_shards;
        return o;
      }()) {}

template <typename K>
Table<K>::Table(TableOptions options)
    : options_(Validated(std::move(options))),
      dim_(options_.dim),
      default_values_(options_.default_values),
      default_value_dim_(static_cast<int64_t>(default_values_.size()) / dim_),
      bloom_(options_.bloom_counters, options_.bloom_hashes, options_.bloom_counter_bytes),
      filter_(options_.filter_freq, /*counts_in_meta=*/options_.bloom_counters == 0),
      no_permission_row_(dim_, options_.no_permission_value) {
  const int num_shards = options_.num_shards;
  num_shards_ = static_cast<uint64_t>(num_shards);
  if (file_tier()) {
    if (options_.storage_lock) storage_lock_ = std::make_unique<StorageLock>(options_.storage_path);
    space_ = std::make_shared<FileSpace>(options_.storage_path, options_.segment_bytes);
  }
  shards_.reserve(num_shards);
  for (int i = 0; i < num_shards; ++i) {
    shards_.push_back(std::make_unique<Shard>());
    shards_.back()->store = NewStore(i);
    shards_.back()->dram = dynamic_cast<DramRowStore*>(shards_.back()->store.get());
  }
}

template <typename K>
std::unique_ptr<RowStore> Table<K>::NewStore(int shard) const {
  if (file_tier()) {
    const int open_files =
        static_cast<int>(std::clamp<uint64_t>(kTableOpenFiles / num_shards_, 2, 16));
    return std::make_unique<FileRowStore>(space_, shard, dim_, options_.cache_bytes / num_shards_,
                                          open_files);
  }
  return std::make_unique<DramRowStore>(dim_);
}

template <typename K>
void Table<K>::LockAll(std::vector<std::unique_lock<std::shared_mutex>>* locks) const {
  locks->reserve(locks->size() + shards_.size());
  for (auto& s : shards_) locks->emplace_back(s->mu);
}

template <typename K>
void Table<K>::RaiseLatestStep(int64_t step) {
  int64_t cur = latest_step_.load(std::memory_order_relaxed);
  while (step > cur && !latest_step_.compare_exchange_weak(cur, step)) {
  }
}

template <typename K>
const float* Table<K>::DefaultRow(K key) const {
  int64_t r = static_cast<int64_t>(key) % default_value_dim_;
  if (r < 0) r += default_value_dim_;
  return default_values_.data() + r * dim_;
}

template <typename K>
std::vector<float> Table<K>::DefaultValues() const {
  std::shared_lock<std::shared_mutex> lock(shards_[0]->mu);
  return default_values_;
}

template <typename K>
void Table<K>::SetDefaultValues(std::vector<float> default_values) {
  const int64_t rows = static_cast<int64_t>(default_values.size()) / dim_;
  if (rows <= 0 || rows * dim_ != static_cast<int64_t>(default_values.size())) {
    throw std::invalid_argument(
        "default_values must hold default_value_dim >= 1 rows of dim floats");
  }
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  default_values_ = std::move(default_values);
  default_value_dim_ = rows;
}

template <typename K>
int64_t Table<K>::Size() const {
  int64_t n = 0;
  ForEachShardShared(
      [&](const Shard& s) { n += static_cast<int64_t>(s.index.live() - s.filtered); });
  return n;
}

template <typename K>
int64_t Table<K>::FilteredSize() const {
  int64_t n = 0;
  ForEachShardShared([&](const Shard& s) { n += static_cast<int64_t>(s.filtered); });
  return n;
}

template <typename K>
uint64_t Table<K>::MemoryBytes() const {
  uint64_t bytes = default_values_.size() * sizeof(float) + bloom_.MemoryBytes();
  ForEachShardShared([&](const Shard& s) {
    bytes += s.index.MemoryBytes() + s.store->Stats().memory_bytes + s.meta.MemoryBytes();
  });
  return bytes;
}

template <typename K>
RowStoreStats Table<K>::StoreStats() const {
  RowStoreStats total;
  ForEachShardShared([&](const Shard& s) { total += s.store->Stats(); });
  return total;
}

template <typename K>
uint64_t Table<K>::InsertNew(Shard& s, K key, uint64_t h, bool admit) {
  s.index.Reserve(IndexMaxLoad());
  const uint64_t i = s.index.Insert(key, h, Entry{key, kNoRow, NewAux(s)});
  ++s.filtered;
  if (admit) {
    try {
      Admit(s, i);
    } catch (...) {
      EraseAt(s, i);  // out of memory: the key is not inserted
      throw;
    }
  }
  return i;
}

template <typename K>
uint32_t Table<K>::Admit(Shard& s, uint64_t i) {
  Entry& e = s.index.entry(i);
  const uint32_t row = s.store->Allocate(DefaultRow(e.key));
  e.row = row;
  --s.filtered;
  ++s.admitted_total;
  Touch(s, e);
  return row;
}

template <typename K>
uint64_t Table<K>::BloomCount(K key) const {
  return bloom_.Count(Hash(key));
}

template <typename K>
std::vector<uint8_t> Table<K>::BloomState() const {
  std::vector<uint8_t> state(BloomStateBytes());
  if (!state.empty()) CopyBloomState(state.data());
  return state;
}

template <typename K>
void Table<K>::CopyBloomState(uint8_t* dst) const {
  if (!bloom()) return;
  // Every shard locked shared: no lookup adds sightings meanwhile.
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  for (const auto& s : shards_) locks.emplace_back(s->mu);
  bloom_.CopyState(dst);
}

template <typename K>
bool Table<K>::SetBloomState(const uint8_t* state, size_t size) {
  if (!bloom()) return false;
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  return bloom_.SetState(state, size);
}

template <typename K>
void Table<K>::EraseAt(Shard& s, uint64_t i) {
  const Entry& e = s.index.entry(i);
  ++s.erased_total;
  if (log_erased_.load(std::memory_order_relaxed)) {
    s.erased_log.emplace_back(e.key, epoch_.load(std::memory_order_relaxed));
  }
  if (e.row == kNoRow) {
    --s.filtered;
  } else {
    s.store->Release(e.row);
  }
  if (options_.track_meta && e.aux != kNoRow) s.meta.Release(e.aux);
  s.index.EraseAt(i);
}

template <typename K>
int64_t Table<K>::CountFreq(int64_t freq, int64_t count) const {
  const int64_t next = SatAdd(freq, count);
  const int64_t cap = options_.freq_cap;
  // A count already past the cap (restored from a checkpoint) is kept.
  if (cap > 0 && next > cap) return freq > cap ? freq : cap;
  return next;
}

template <typename K>
const float* Table<K>::Resolve(Shard& s, K key, uint64_t h, bool insert, int64_t now, int64_t count,
                               int64_t* admitted, uint64_t* hits) {
  // `count` occurrences of the key at once; all of them read the same row.
  // With a filter (DeepRec's rule) a training lookup reads the row only if
  // the key was admitted before it: the lookup whose count reaches the
  // threshold admits the key (so this step's gradient trains its new row)
  // but still reads no_permission_value.
  const bool gate = filter_.gates() && (filtering() || bloom());
  const int64_t idx = s.index.Find(key, h);
  if (idx >= 0) {
    Entry& e = s.index.entry(idx);
    int64_t* m = Meta(s, e);
    if (insert && m) {
      m[kFreq] = CountFreq(m[kFreq], count);
      m[kEpoch] = epoch_.load(std::memory_order_relaxed);
    }
    if (e.row != kNoRow) {
      *hits += static_cast<uint64_t>(count);
      return s.Value(e.row, /*write=*/false);
    }
    // Counted by the counter filter, not admitted yet.
    if (!insert) return no_permission_row_.data();
    m[kVersion] = now;  // last seen
    if (filter_.Admits(m[kFreq])) {
      ++*admitted;
      Admit(s, static_cast<uint64_t>(idx));
    }
    return no_permission_row_.data();
  }
  if (!insert) return filtering() || bloom() ? no_permission_row_.data() : DefaultRow(key);
  int64_t freq = count;
  bool admit = true;
  if (bloom()) {
    // One sighting at a time (k positions may share a counter, so the
    // estimate need not grow by exactly 1 per sighting); once admitted, the
    // remaining occurrences count on the key's own frequency.
    int64_t seen = 0;
    freq = 0;
    while (seen < count) {
      ++seen;
      freq = static_cast<int64_t>(std::min<uint64_t>(bloom_.Add(h), INT64_MAX));
      if (filter_.Admits(freq)) break;
    }
    if (!filter_.Admits(freq)) return no_permission_row_.data();
    freq = SatAdd(freq, count - seen);
  } else if (filtering()) {
    admit = filter_.Admits(count);
  }
  const Entry& e = s.index.entry(InsertNew(s, key, h, admit));
  if (int64_t* m = Meta(s, e)) {
    m[kFreq] = CountFreq(0, freq);
    m[kVersion] = now;  // first seen; Apply stamps updates
  }
  if (admit) ++*admitted;
  if (gate || !admit) return no_permission_row_.data();
  // Occurrence by occurrence, the first inserts the key and the others find
  // its row (a filter's admission reads no_permission_value, gated above).
  if (!filtering() && !bloom()) *hits += static_cast<uint64_t>(count - 1);
  return s.Value(e.row, /*write=*/false);
}

template <typename K>
void Table<K>::PrefetchRows(Shard& s, const K* keys, const uint64_t* hashes, int64_t n) {
  // The rows of the keys already admitted, for the store to load those it
  // does not hold in one pass (keys not found are left to the lookup).
  constexpr int64_t kAhead = 16;
  std::vector<uint32_t> rows;
  rows.reserve(static_cast<size_t>(n));
  const bool probe = !s.index.empty_storage();
  for (int64_t j = 0; j < n; ++j) {
    if (probe && j + kAhead < n) s.index.PrefetchProbe(hashes[j + kAhead]);
    const int64_t idx = s.index.Find(keys[j], hashes[j]);
    if (idx >= 0 && s.index.entry(idx).row != kNoRow) rows.push_back(s.index.entry(idx).row);
  }
  s.store->Prefetch(rows.data(), rows.size());
}

template <typename K>
template <bool kCounted>
int64_t Table<K>::LookupImpl(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                             const int32_t* counts, int64_t n, bool insert, float* out) {
  Shard& s = *shards_[shard];
  // A file store's cache changes on reads too: it takes the lock exclusively.
  const bool stable = s.store->stable_pointers();
  std::unique_lock<std::shared_mutex> wlock(s.mu, std::defer_lock);
  std::shared_lock<std::shared_mutex> rlock(s.mu, std::defer_lock);
  if (insert || !stable) {
    wlock.lock();
  } else {
    rlock.lock();
  }
  if (!stable) PrefetchRows(s, keys, hashes, n);
  int64_t inserted = 0;
  uint64_t hits = 0, occurrences = 0;
  const int64_t now = SatAdd(LatestStep(), 1);  // the step this lookup belongs to
  if (!kCounted && insert && options_.filter_freq > 1 && n > 1) {
    // With a filter, equal keys of the batch are resolved once with their
    // count, so that all their occurrences read the same value: the first
    // occurrence's output row is copied to the others.
    BatchGroups groups(n);
    std::vector<int64_t> first, count;
    std::vector<int64_t> which(n);
    for (int64_t j = 0; j < n; ++j) {
      bool created;
      const int64_t g = groups.Group(
          hashes[j], [&](int64_t other) { return keys[first[other]] == keys[j]; }, &created);
      if (created) {
        first.push_back(j);
        count.push_back(0);
      }
      which[j] = g;
      ++count[g];
    }
    for (size_t u = 0; u < first.size(); ++u) {
      const int64_t j = first[u];
      CopyRow(out + order[j] * dim_,
              Resolve(s, keys[j], hashes[j], true, now, count[u], &inserted, &hits), dim_);
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t f = first[which[j]];
      if (f != j) CopyRow(out + order[j] * dim_, out + order[f] * dim_, dim_);
    }
    CountLookups(s, static_cast<uint64_t>(n), hits);
    return inserted;
  }
  if (stable && !filtering() && !bloom()) {
    LookupPipelined<kCounted>(s, keys, hashes, order, counts, n, insert, now, out, &inserted, &hits,
                              &occurrences);
    CountLookups(s, occurrences, hits);
    return inserted;
  }
  // Keys go in blocks: resolve a block (its index slots were prefetched
  // while the previous block was resolved) and prefetch each row found and
  // its output, then copy the block's rows, by then on their way to the
  // cache. A store without stable pointers (the file tier's cache may drop
  // a row to load the next) copies each row as soon as it is resolved.
  constexpr int64_t kMaxBlock = 16;
  const int64_t block = kMaxBlock;
  const float* src[kMaxBlock];
  auto prefetch_slots = [&](int64_t begin, int64_t end) {
    if (s.index.empty_storage()) return;
    for (int64_t j = begin; j < end; ++j) {
      s.index.PrefetchProbe(hashes[j]);
    }
  };
  prefetch_slots(0, std::min(n, block));
  for (int64_t b = 0; b < n; b += block) {
    const int64_t e = std::min(n, b + block);
    prefetch_slots(e, std::min(n, e + block));
    for (int64_t j = b; j < e; ++j) {
      const int64_t c = kCounted ? counts[order[j]] : 1;
      occurrences += static_cast<uint64_t>(c);
      src[j - b] = Resolve(s, keys[j], hashes[j], insert, now, c, &inserted, &hits);
      if (!stable) {
        CopyRow(out + order[j] * dim_, src[j - b], dim_);
        continue;
      }
      PrefetchRow(src[j - b], dim_);
      __builtin_prefetch(out + order[j] * dim_, 1);
    }
    if (!stable) continue;
    for (int64_t j = b; j < e; ++j) CopyRow(out + order[j] * dim_, src[j - b], dim_);
  }
  CountLookups(s, occurrences, hits);
  return inserted;
}

template <typename K>
template <bool kCounted>
void Table<K>::LookupPipelined(Shard& s, const K* keys, const uint64_t* hashes,
                               const int64_t* order, const int32_t* counts, int64_t n, bool insert,
                               int64_t now, float* out, int64_t* inserted, uint64_t* hits,
                               uint64_t* occurrences) {
  // Three stages kSlotAhead and kRowAhead keys apart: prefetch key j's index
  // slot; find key j (its slot is in cache by then) and prefetch its row,
  // its output row and, for a training lookup, its metadata; copy the row
  // and count the occurrences of the key kRowAhead keys back. Missing keys
  // go through Resolve at once (an insert may rehash the index: stage 3
  // keeps only row and metadata pointers, which stay valid).
  constexpr int64_t kSlotAhead = 32;
  constexpr int64_t kRowAhead = 16;
  static_assert(IsPowerOfTwo(kRowAhead), "ring slots are j & (kRowAhead - 1)");
  const float* rows[kRowAhead];
  int64_t* metas[kRowAhead];
  int64_t meta_counts[kRowAhead];
  const int64_t epoch = epoch_.load(std::memory_order_relaxed);
  auto prefetch_slot = [&](int64_t j) { s.index.PrefetchProbe(hashes[j]); };
  if (!s.index.empty_storage()) {
    for (int64_t j = 0; j < std::min(n, kSlotAhead); ++j) prefetch_slot(j);
  }
  for (int64_t j = 0; j < n + kRowAhead; ++j) {
    // Stage 3 first: key j takes over the ring entry of key j - kRowAhead.
    if (j >= kRowAhead) {
      const int64_t i = j - kRowAhead;
      const int64_t r = i & (kRowAhead - 1);
      CopyRow(out + order[i] * dim_, rows[r], dim_);
      if (int64_t* m = metas[r]) {
        m[kFreq] = CountFreq(m[kFreq], meta_counts[r]);
        m[kEpoch] = epoch;
      }
    }
    if (j < n) {
      if (j + kSlotAhead < n && !s.index.empty_storage()) prefetch_slot(j + kSlotAhead);
      const int64_t c = kCounted ? counts[order[j]] : 1;
      *occurrences += static_cast<uint64_t>(c);
      const int64_t idx = s.index.Find(keys[j], hashes[j]);
      const float* row;
      int64_t* m = nullptr;
      if (idx >= 0 && s.index.entry(idx).row != kNoRow) {
        const Entry& e = s.index.entry(idx);
        row = s.Value(e.row, /*write=*/false);
        *hits += static_cast<uint64_t>(c);
        if (insert && (m = Meta(s, e)) != nullptr) __builtin_prefetch(m, 1);
      } else {
        row = Resolve(s, keys[j], hashes[j], insert, now, c, inserted, hits);
      }
      PrefetchRow(row, dim_);
      __builtin_prefetch(out + order[j] * dim_, 1);
      rows[j & (kRowAhead - 1)] = row;
      metas[j & (kRowAhead - 1)] = m;
      meta_counts[j & (kRowAhead - 1)] = c;
    }
  }
}

template <typename K>
int64_t Table<K>::LookupOrdered(const K* keys, int64_t n, bool insert, float* out, int64_t stride) {
  if (n <= 0) return 0;
  if (!insert) {
    // Rows found a block at a time, then copied (see OrderedReader).
    constexpr int64_t kBlock = 256;
    const float* rows[kBlock];
    OrderedReader reader(*this);
    const bool stream = StreamableRows(out, dim_, stride);
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t m = std::min(kBlock, n - b);
      reader.Find(keys + b, m, rows);
      if (stream) {
        for (int64_t j = 0; j < m; ++j) StreamRow(out + (b + j) * stride, rows[j], dim_);
      } else {
        for (int64_t j = 0; j < m; ++j) CopyRow(out + (b + j) * stride, rows[j], dim_);
      }
    }
    if (stream) StreamFence();
    return 0;
  }
  const int shards = num_shards();
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(shards);
  for (auto& sp : shards_) locks.emplace_back(sp->mu);  // in shard order, as LockAll
  const int64_t now = SatAdd(LatestStep(), 1);
  const int64_t epoch = epoch_.load(std::memory_order_relaxed);
  std::vector<int64_t> missing;  // batch positions of keys to insert
  // Three stages kSlotAhead and kRowAhead keys apart, as LookupPipelined:
  // hash key j and prefetch its index slot; find key j - kSlotAhead and
  // prefetch its row, output and metadata; copy the row of key
  // j - kSlotAhead - kRowAhead and count its frequency.
  constexpr int64_t kSlotAhead = 16;
  constexpr int64_t kRowAhead = 8;
  static_assert(IsPowerOfTwo(kSlotAhead) && IsPowerOfTwo(kRowAhead), "rings indexed by & (n - 1)");
  uint64_t hashes[kSlotAhead];
  const float* rows[kRowAhead];
  int64_t* metas[kRowAhead];
  const bool track = options_.track_meta;
  for (int64_t j = 0; j < n + kSlotAhead + kRowAhead; ++j) {
    const int64_t c = j - kSlotAhead - kRowAhead;
    if (c >= 0) {
      const int64_t r = c & (kRowAhead - 1);
      if (rows[r] != nullptr) CopyRow(out + c * stride, rows[r], dim_);
      if (int64_t* m = metas[r]) {
        int64_t f = LoadRelaxed(m + kFreq);
        while (!__atomic_compare_exchange_n(m + kFreq, &f, CountFreq(f, 1), /*weak=*/true,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        }
        if (LoadRelaxed(m + kEpoch) != epoch) StoreRelaxed(m + kEpoch, epoch);
      }
    }
    const int64_t f = j - kSlotAhead;
    if (f >= 0 && f < n) {
      const uint64_t h = hashes[f & (kSlotAhead - 1)];
      const int sh = ShardOf(h);
      Shard& s = *shards_[sh];
      const int64_t idx = s.index.Find(keys[f], h);
      const float* row = nullptr;
      int64_t* m = nullptr;
      if (idx >= 0 && s.index.entry(idx).row != kNoRow) {
        const Entry& e = s.index.entry(idx);
        row = s.dram->Value(e.row, /*write=*/false);
        if (track && e.aux != kNoRow) {
          m = s.meta.Row(e.aux);
          __builtin_prefetch(m, 1);
        }
      } else {
        missing.push_back(f);
      }
      if (row != nullptr) {
        PrefetchRow(row, dim_);
        __builtin_prefetch(out + f * stride, 1);
      }
      rows[f & (kRowAhead - 1)] = row;
      metas[f & (kRowAhead - 1)] = m;
    }
    if (j < n) {
      const uint64_t h = Hash(keys[j]);
      hashes[j & (kSlotAhead - 1)] = h;
      const Index& index = shards_[ShardOf(h)]->index;
      if (!index.empty_storage()) {
        index.PrefetchProbe(h);
      }
    }
  }
  locks.clear();
  // Every occurrence is a lookup; those not missing found their row.
  CountLookups(*shards_[0], n, n - missing.size());
  if (missing.empty()) return 0;
  // Missing keys (training): shard by shard, in batch order within a shard,
  // under the exclusive lock; Resolve inserts a key or finds it inserted by
  // an earlier occurrence (or by another thread meanwhile).
  std::vector<std::pair<int, int64_t>> by_shard;
  by_shard.reserve(missing.size());
  for (int64_t i : missing) by_shard.emplace_back(ShardOf(Hash(keys[i])), i);
  std::sort(by_shard.begin(), by_shard.end());
  int64_t inserted = 0;
  for (size_t b = 0; b < by_shard.size();) {
    const int sh = by_shard[b].first;
    Shard& s = *shards_[sh];
    std::unique_lock<std::shared_mutex> lock(s.mu);
    uint64_t hits = 0;
    for (; b < by_shard.size() && by_shard[b].first == sh; ++b) {
      const int64_t i = by_shard[b].second;
      CopyRow(out + i * stride,
              Resolve(s, keys[i], Hash(keys[i]), /*insert=*/true, now, 1, &inserted, &hits), dim_);
    }
    CountLookups(s, 0, hits);
  }
  return inserted;
}

template <typename K>
Table<K>::OrderedReader::OrderedReader(Table& table) : table_(table) {
  locks_.reserve(table.shards_.size());
  views_.reserve(table.shards_.size());
  for (auto& sp : table.shards_) {
    locks_.emplace_back(sp->mu);  // in shard order, as LockAll
    views_.push_back(
        ShardView{sp->index.data(), sp->index.mask(), sp->dram->value_bases(), sp->index.reach()});
  }
}

template <typename K>
Table<K>::OrderedReader::~OrderedReader() {
  if (lookups_ > 0) table_.CountLookups(*table_.shards_[0], lookups_, lookups_ - defaults_);
}

template <typename K>
void Table<K>::OrderedReader::Find(const K* keys, int64_t n, const float** rows, bool read_later) {
  if (read_later) {
    FindImpl<true>(keys, n, rows);
  } else {
    FindImpl<false>(keys, n, rows);
  }
}

template <typename K>
template <bool kReadLater>
void Table<K>::OrderedReader::FindImpl(const K* keys, int64_t n, const float** rows) {
  // Two stages kSlotAhead keys apart: hash key j and prefetch its index
  // slot; find key j - kSlotAhead and prefetch its row. Rows read after a
  // block of ~1k finds (kReadLater) would leave L1 before they are read,
  // so they go into L2, and slots are fetched 32 keys ahead (a find-and-sum
  // over 26 tables ran fastest so, against rows into L1 and 16 or 64 ahead:
  // docs/history.md, session 14). Rows copied after a block of 256
  // (LookupOrdered) fit L1 and go there, 16 ahead.
  constexpr int64_t kSlotAhead = kReadLater ? 32 : 16;
  static_assert(IsPowerOfTwo(kSlotAhead), "ring slots are j & (kSlotAhead - 1)");
  uint64_t hashes[kSlotAhead];
  int shard_of[kSlotAhead];
  const Table& t = table_;
  // Locals, not members: the count stores could alias the members.
  const int64_t dim = t.dim_;
  const uint64_t num_shards = t.num_shards_;
  const ShardView* views = views_.data();
  uint64_t defaults = 0;
  for (int64_t j = 0; j < n + kSlotAhead; ++j) {
    const int64_t f = j - kSlotAhead;
    if (f >= 0) {
      const int sh = shard_of[f & (kSlotAhead - 1)];
      const ShardView& v = views[sh];
      const auto* e = Index::FindIn(v.entries, v.mask, keys[f], hashes[f & (kSlotAhead - 1)]);
      const float* row;
      if (e && e->row != kNoRow) {
        row = ChunkedArena<float>::RowIn(v.bases, e->row, dim);
      } else {
        row = t.DefaultRow(keys[f]);
        ++defaults;
      }
      PrefetchRow<kReadLater ? 2 : 3>(row, dim);
      rows[f] = row;
    }
    if (j < n) {
      const uint64_t h = Hash(keys[j]);
      hashes[j & (kSlotAhead - 1)] = h;
      const int sh = ShardOfHash(h, num_shards);
      shard_of[j & (kSlotAhead - 1)] = sh;
      Index::PrefetchProbe(views[sh].entries, views[sh].mask, h, views[sh].reach);
    }
  }
  lookups_ += static_cast<uint64_t>(n);
  defaults_ += defaults;
}

template <typename K>
int64_t Table<K>::Lookup(int shard, const K* keys, const uint64_t* hashes, const int64_t* order,
                         int64_t n, bool insert, float* out) {
  return LookupImpl<false>(shard, keys, hashes, order, nullptr, n, insert, out);
}

template <typename K>
int64_t Table<K>::LookupCounted(int shard, const K* keys, const uint64_t* hashes,
                                const int64_t* order, const int32_t* counts, int64_t n, bool insert,
                                float* out) {
  return LookupImpl<true>(shard, keys, hashes, order, counts, n, insert, out);
}

template <typename K>
int Table<K>::AddSlot(const std::string& name, int64_t width, float init) {
  if (width <= 0) throw std::invalid_argument("slot width must be positive");
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  std::lock_guard<std::mutex> specs_lock(slot_specs_mu_);
  for (size_t j = 0; j < slot_specs_.size(); ++j) {
    if (slot_specs_[j].name == name) {
      if (slot_specs_[j].width != width) {
        throw std::invalid_argument("slot '" + name + "' exists with width " +
                                    std::to_string(slot_specs_[j].width));
      }
      slot_specs_[j].init = init;
      for (auto& sp : shards_) sp->store->SetSlotInit(j, init);
      return static_cast<int>(j);
    }
  }
  // Reserve everything first, then commit with steps that cannot fail, so
  // that running out of memory leaves the table as it was.
  for (auto& sp : shards_) sp->store->ReserveSlot(width, init);
  slot_specs_.reserve(slot_specs_.size() + 1);
  for (auto& sp : shards_) sp->store->CommitSlot();
  slot_specs_.push_back(SlotSpec{name, width, init});
  return static_cast<int>(slot_specs_.size() - 1);
}

template <typename K>
int Table<K>::SlotIndex(const std::string& name) const {
  std::lock_guard<std::mutex> lock(slot_specs_mu_);
  for (size_t j = 0; j < slot_specs_.size(); ++j) {
    if (slot_specs_[j].name == name) return static_cast<int>(j);
  }
  return -1;
}

template <typename K>
std::vector<SlotSpec> Table<K>::Slots() const {
  std::lock_guard<std::mutex> lock(slot_specs_mu_);
  return slot_specs_;
}

template <typename K>
void Table<K>::Import(const K* keys, const float* values, const int64_t* freqs,
                      const int64_t* versions, int64_t n, const float* slots,
                      const std::vector<int>& slot_ids, const std::vector<int64_t>& slot_widths) {
  if (n == 0) return;  // e.g. a promotion step with nothing to copy
  int64_t total_width = 0;
  for (int64_t w : slot_widths) total_width += w;
  ForEachKeyLocked(keys, n, [&](int64_t i, Shard& s, uint64_t h, int64_t idx) {
    const bool existed = idx >= 0;
    if (idx < 0) idx = static_cast<int64_t>(InsertNew(s, keys[i], h, /*admit=*/true));
    if (s.index.entry(idx).row == kNoRow) Admit(s, static_cast<uint64_t>(idx));
    Entry& e = s.index.entry(idx);
    std::copy(values + i * dim_, values + (i + 1) * dim_, s.Value(e.row, /*write=*/true));
    if (int64_t* m = Meta(s, e)) {
      // A negative frequency keeps the count of a key already present.
      if (!freqs || freqs[i] >= 0) {
        m[kFreq] = freqs ? freqs[i] : 0;
      } else if (!existed) {
        m[kFreq] = 0;
      }
      m[kVersion] = versions ? versions[i] : 0;
      if (versions) RaiseLatestStep(versions[i]);
    }
    const float* src = slots + i * total_width;
    for (size_t j = 0; j < slot_ids.size(); ++j) {
      std::copy(src, src + slot_widths[j], s.store->Slot(slot_ids[j], e.row, /*write=*/true));
      src += slot_widths[j];
    }
    Touch(s, e);
  });
}

template <typename K>
void Table<K>::ImportFiltered(const K* keys, const int64_t* freqs, const int64_t* versions,
                              int64_t n) {
  if (n == 0 || !filtering() || bloom()) return;  // only the counter filter keeps such keys
  ForEachKeyLocked(keys, n, [&](int64_t i, Shard& s, uint64_t h, int64_t idx) {
    if (idx >= 0 && s.index.entry(idx).row != kNoRow) return;  // stays admitted
    if (idx < 0) idx = static_cast<int64_t>(InsertNew(s, keys[i], h, /*admit=*/false));
    int64_t* m = Meta(s, s.index.entry(idx));
    m[kFreq] = freqs[i];
    m[kVersion] = versions[i];
    m[kEpoch] = epoch_.load(std::memory_order_relaxed);
  });
}

template <typename K>
int64_t Table<K>::Evict(int64_t now, int64_t steps_to_live, float l2_threshold) {
  if (now < 0) now = LatestStep();
  const EvictionPolicy policy(now, steps_to_live, l2_threshold, options_.track_meta);
  int64_t erased = 0;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    std::unique_lock<std::shared_mutex> lock(s.mu);
    for (uint64_t i = 0; i < s.index.capacity(); ++i) {
      if (!s.index.Occupied(i)) continue;
      const Entry& e = s.index.entry(i);
      const int64_t* m = Meta(s, e);
      bool evict = m && policy.StaleVersion(m + kVersion);
      if (!evict && policy.needs_values() && e.row != kNoRow) {
        evict = policy.SmallWeight(s.Value(e.row, /*write=*/false), dim_);
      }
      if (evict) {
        EraseAt(s, i);
        ++erased;
      }
    }
  }
  return erased;
}

template <typename K>
bool Table<K>::Erase(K key) {
  const uint64_t h = Hash(key);
  Shard& s = *shards_[ShardOf(h)];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  const int64_t idx = s.index.Find(key, h);
  if (idx < 0) return false;
  EraseAt(s, static_cast<uint64_t>(idx));
  return true;
}

template <typename K>
void Table<K>::SwapContents(Table& other) {
  if (other.dim_ != dim_ || other.shards_.size() != shards_.size() ||
      !other.bloom_.SameShape(bloom_) || other.options_.track_meta != options_.track_meta) {
    throw std::invalid_argument("SwapContents: the tables differ in shape");
  }
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  other.LockAll(&locks);
  std::scoped_lock specs_lock(slot_specs_mu_, other.slot_specs_mu_);
  for (size_t j = 0; j < slot_specs_.size(); ++j) {
    if (j >= other.slot_specs_.size() || other.slot_specs_[j].name != slot_specs_[j].name ||
        other.slot_specs_[j].width != slot_specs_[j].width) {
      throw std::invalid_argument("the table's optimizer slots changed during the import");
    }
  }
  for (size_t i = 0; i < shards_.size(); ++i) shards_[i]->SwapContents(*other.shards_[i]);
  // Rows now carry the other table's epochs: no delta spans this.
  reset_epoch_ = ChangeEpoch();
  other.reset_epoch_ = other.ChangeEpoch();
  bloom_.SwapCounters(other.bloom_);
  std::swap(slot_specs_, other.slot_specs_);
  std::swap(default_values_, other.default_values_);
  std::swap(default_value_dim_, other.default_value_dim_);
  RaiseLatestStep(other.LatestStep());
}

template <typename K>
void Table<K>::Clear() {
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  for (auto& sp : shards_) sp->Reset();
  bloom_.Clear();
  reset_epoch_ = ChangeEpoch();  // no delta spans a clear
}

template <typename K>
bool Table<K>::Find(K key, std::vector<float>* value, int64_t* freq, int64_t* version) const {
  const uint64_t h = Hash(key);
  const Shard& s = *shards_[ShardOf(h)];
  std::shared_lock<std::shared_mutex> lock(s.mu);
  const int64_t idx = s.index.Find(key, h);
  if (idx < 0) return false;
  const Entry& e = s.index.entry(idx);
  if (e.row == kNoRow) {
    value->clear();
  } else {
    int64_t width = 0;
    for (const auto& spec : slot_specs_) width += spec.width;
    std::vector<float> slots(width);
    value->resize(dim_);
    s.store->Read(e.row, value->data(), slots.data());
  }
  const int64_t* m = Meta(s, e);
  *freq = m ? LoadRelaxed(m + kFreq) : 0;
  *version = m ? m[kVersion] : 0;
  return true;
}

// --- Change tracking ------------------------------------------------------

template <typename K>
void Table<K>::CountLookups(Shard& s, uint64_t occurrences, uint64_t hits) {
  s.lookups.fetch_add(occurrences, std::memory_order_relaxed);
  s.hits.fetch_add(hits, std::memory_order_relaxed);
}

template <typename K>
int64_t Table<K>::MarkChanges() {
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  log_erased_.store(true, std::memory_order_relaxed);
  return epoch_.fetch_add(1, std::memory_order_relaxed);
}

template <typename K>
void Table<K>::TrimErasedLog(int64_t upto) {
  for (auto& sp : shards_) {
    Shard& s = *sp;
    std::unique_lock<std::shared_mutex> lock(s.mu);
    auto& log = s.erased_log;
    log.erase(std::remove_if(log.begin(), log.end(),
                             [upto](const std::pair<K, int64_t>& ke) { return ke.second <= upto; }),
              log.end());
    if (log.capacity() > 4 * log.size() + 64) log.shrink_to_fit();
  }
}

template <typename K>
int64_t Table<K>::ErasedLogSize() const {
  int64_t n = 0;
  ForEachShardShared([&](const Shard& s) { n += static_cast<int64_t>(s.erased_log.size()); });
  return n;
}

template <typename K>
TableCounters Table<K>::Counters() const {
  TableCounters c;
  ForEachShardShared([&](const Shard& s) {
    c.lookups += s.lookups.load(std::memory_order_relaxed);
    c.hits += s.hits.load(std::memory_order_relaxed);
    c.admitted += s.admitted_total;
    c.erased += s.erased_total;
  });
  return c;
}

template class Table<int64_t>;
template class Table<int32_t>;

}  // namespace kv
}  // namespace kre
