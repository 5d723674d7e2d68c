// Copyright keras_rec_emb authors. Apache-2.0.
#include "kv/table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace kre {
namespace kv {

void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes) {
  const double ln2 = std::log(2.0);
  const double m = std::ceil(-static_cast<double>(n) * std::log(p) / (ln2 * ln2));
  *counters = static_cast<uint64_t>(std::max(1.0, m));
  *hashes = std::max(1, static_cast<int>(std::lround(m / static_cast<double>(n) * ln2)));
}

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

// A row id from the free list, or the next new one (then *fresh is true and
// the arenas must grow to hold it).
uint32_t TakeRow(std::vector<uint32_t>* free, uint32_t* next, bool* fresh) {
  *fresh = free->empty();
  if (!*fresh) {
    const uint32_t row = free->back();
    free->pop_back();
    return row;
  }
  if (*next == UINT32_MAX) throw std::length_error("shard is full");
  return (*next)++;
}

// Maps a well-mixed 64-bit value to [0, n) with a multiply instead of a
// division (Lemire's fast range reduction).
inline uint64_t Reduce(uint64_t x, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * n) >> 64);
}

// Bloom counters of 1, 2, 4 or 8 bytes, read and incremented atomically
// (relaxed: a counter is an estimate; shards that share one race only on
// the count, which the compare-exchange keeps exact).
template <typename C>
uint64_t LoadCounter(const uint8_t* base, uint64_t i) {
  return __atomic_load_n(reinterpret_cast<const C*>(base) + i, __ATOMIC_RELAXED);
}

template <typename C>
void IncrementCounter(uint8_t* base, uint64_t i) {
  C* c = reinterpret_cast<C*>(base) + i;
  C v = __atomic_load_n(c, __ATOMIC_RELAXED);
  while (v != static_cast<C>(~C{0}) &&  // saturated counters stay
         !__atomic_compare_exchange_n(c, &v, static_cast<C>(v + 1), /*weak=*/true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

uint64_t GetCounter(const uint8_t* base, uint64_t i, int bytes) {
  switch (bytes) {
    case 1: return LoadCounter<uint8_t>(base, i);
    case 2: return LoadCounter<uint16_t>(base, i);
    case 4: return LoadCounter<uint32_t>(base, i);
    default: return LoadCounter<uint64_t>(base, i);
  }
}

void BumpCounter(uint8_t* base, uint64_t i, int bytes) {
  switch (bytes) {
    case 1: return IncrementCounter<uint8_t>(base, i);
    case 2: return IncrementCounter<uint16_t>(base, i);
    case 4: return IncrementCounter<uint32_t>(base, i);
    default: return IncrementCounter<uint64_t>(base, i);
  }
}

// Appended to the saved Bloom counters: tells this layout (one filter for
// the table) from the per-shard layout of earlier versions, which cannot be
// mapped to it and is not restored.
constexpr char kBloomMagic[8] = {'K', 'R', 'E', 'C', 'B', 'F', '2', '\0'};

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
      no_permission_row_(dim_, options_.no_permission_value) {
  const int num_shards = options_.num_shards;
  num_shards_ = static_cast<uint64_t>(num_shards);
  if (bloom()) {
    const uint64_t bytes = options_.bloom_counters * options_.bloom_counter_bytes;
    bloom_words_.assign((bytes + 7) / 8, 0);
  }
  shards_.reserve(num_shards);
  for (int i = 0; i < num_shards; ++i) {
    shards_.push_back(std::make_unique<Shard>());
    shards_.back()->values = ChunkedArena<float>(dim_);
  }
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
  for (auto& s : shards_) locks.emplace_back(s->mu);
  default_values_ = std::move(default_values);
  default_value_dim_ = rows;
}

template <typename K>
int64_t Table<K>::Size() const {
  int64_t n = 0;
  for (const auto& s : shards_) {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    n += static_cast<int64_t>(s->live - s->filtered);
  }
  return n;
}

template <typename K>
int64_t Table<K>::FilteredSize() const {
  int64_t n = 0;
  for (const auto& s : shards_) {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    n += static_cast<int64_t>(s->filtered);
  }
  return n;
}

template <typename K>
uint64_t Table<K>::MemoryBytes() const {
  uint64_t bytes = default_values_.size() * sizeof(float) +
                   bloom_words_.capacity() * sizeof(uint64_t);
  for (const auto& sp : shards_) {
    const Shard& s = *sp;
    std::shared_lock<std::shared_mutex> lock(s.mu);
    bytes += s.ctrl.capacity() + s.entries.capacity() * sizeof(Entry);
    bytes += s.values.BytesAllocated() + s.meta.BytesAllocated();
    for (const auto& a : s.slots) bytes += a.BytesAllocated();
    bytes += (s.free_rows.capacity() + s.free_meta.capacity()) * sizeof(uint32_t);
  }
  return bytes;
}

template <typename K>
int64_t Table<K>::FindIndex(const Shard& s, K key, uint64_t h) const {
  if (s.ctrl.empty()) return -1;
  const uint8_t tag = Tag(h);
  uint64_t i = h & s.mask;
  while (true) {
    const uint8_t c = s.ctrl[i];
    if (c == tag && s.entries[i].key == key) return static_cast<int64_t>(i);
    if (c == kEmpty) return -1;
    i = (i + 1) & s.mask;
  }
}

template <typename K>
void Table<K>::Rehash(Shard& s, uint64_t new_capacity) {
  std::vector<uint8_t> ctrl(new_capacity, kEmpty);
  std::vector<Entry> entries(new_capacity);
  const uint64_t mask = new_capacity - 1;
  for (uint64_t i = 0; i < s.ctrl.size(); ++i) {
    if (s.ctrl[i] & 0x80) continue;
    const uint64_t h = Hash(s.entries[i].key);
    uint64_t j = h & mask;
    while (ctrl[j] != kEmpty) j = (j + 1) & mask;
    ctrl[j] = Tag(h);
    entries[j] = s.entries[i];
  }
  s.ctrl.swap(ctrl);
  s.entries.swap(entries);
  s.mask = mask;
  s.tombstones = 0;
}

template <typename K>
uint64_t Table<K>::InsertNew(Shard& s, K key, uint64_t h, bool admit) {
  const uint64_t cap = s.ctrl.size();
  if ((s.live + s.tombstones + 1) * 4 > cap * 3) {
    // Grow when live entries alone pass 3/8 of capacity; otherwise the load
    // is mostly tombstones and a same-size rehash clears them.
    uint64_t new_cap = cap == 0 ? kMinCapacity : cap;
    if ((s.live + 1) * 8 > cap * 3) new_cap = std::max(kMinCapacity, cap * 2);
    Rehash(s, new_cap);
  }
  uint32_t meta_row = kNoRow;
  if (options_.track_meta) {
    bool fresh;
    meta_row = TakeRow(&s.free_meta, &s.next_meta, &fresh);
    if (fresh) {
      try {
        s.meta.EnsureCapacity(s.next_meta, 0);
      } catch (...) {
        --s.next_meta;  // out of memory: the row was not taken
        throw;
      }
    }
    int64_t* m = s.meta.Row(meta_row);
    m[kFreq] = 0;
    m[kVersion] = 0;
  }
  uint64_t i = h & s.mask;
  while (!(s.ctrl[i] & 0x80)) i = (i + 1) & s.mask;
  if (s.ctrl[i] == kDeleted) --s.tombstones;
  s.ctrl[i] = Tag(h);
  s.entries[i] = Entry{key, kNoRow, meta_row};
  ++s.live;
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
  bool fresh;
  const uint32_t row = TakeRow(&s.free_rows, &s.next_row, &fresh);
  if (fresh) {
    try {
      s.values.EnsureCapacity(s.next_row, 0.0f);
      for (size_t j = 0; j < s.slots.size(); ++j) {
        s.slots[j].EnsureCapacity(s.next_row, slot_specs_[j].init);
      }
    } catch (...) {
      --s.next_row;  // out of memory: the row was not taken
      throw;
    }
  }
  const float* init = DefaultRow(s.entries[i].key);
  std::copy(init, init + dim_, s.values.Row(row));
  for (size_t j = 0; j < s.slots.size(); ++j) {
    float* sv = s.slots[j].Row(row);
    std::fill(sv, sv + slot_specs_[j].width, slot_specs_[j].init);
  }
  s.entries[i].row = row;
  --s.filtered;
  return row;
}

template <typename K>
uint64_t Table<K>::BloomSlot(uint64_t h, int k) const {
  // Double hashing over two re-mixed hashes (h's own middle bits select the
  // shard), reduced to the filter's range by a multiply. The filter is one
  // for the table: a key's k positions range over all m counters whatever
  // the shard count, so the false-positive rate is the one it was sized
  // for.
  const uint64_t base = HashKey(h ^ 0x9e3779b97f4a7c15ULL);
  // (Not HashKey(h): for h = 0 that is 0, a step of 1 that the multiply
  // maps every position onto one counter.)
  const uint64_t step = HashKey(h ^ 0x632be59bd9b4e019ULL) | 1;
  return Reduce(base + static_cast<uint64_t>(k) * step, options_.bloom_counters);
}

template <typename K>
uint64_t Table<K>::BloomMin(uint64_t h) const {
  const int bytes = options_.bloom_counter_bytes;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(bloom_words_.data());
  uint64_t least = UINT64_MAX;
  for (int k = 0; k < options_.bloom_hashes; ++k) {
    least = std::min(least, GetCounter(base, BloomSlot(h, k), bytes));
  }
  return least;
}

template <typename K>
uint64_t Table<K>::BloomAdd(uint64_t h) {
  const int bytes = options_.bloom_counter_bytes;
  uint8_t* base = reinterpret_cast<uint8_t*>(bloom_words_.data());
  // Each distinct position once per sighting: in a small filter two of a
  // key's k positions may coincide, and counting that counter twice would
  // let a key pass the threshold on fewer sightings than it has.
  uint64_t small[64];
  std::vector<uint64_t> large;
  uint64_t* pos = small;
  if (options_.bloom_hashes > 64) {
    large.resize(options_.bloom_hashes);
    pos = large.data();
  }
  int distinct = 0;
  for (int k = 0; k < options_.bloom_hashes; ++k) {
    const uint64_t i = BloomSlot(h, k);
    bool seen = false;
    for (int j = 0; j < distinct && !seen; ++j) seen = pos[j] == i;
    if (!seen) pos[distinct++] = i;
  }
  for (int j = 0; j < distinct; ++j) BumpCounter(base, pos[j], bytes);
  return BloomMin(h);
}

template <typename K>
uint64_t Table<K>::BloomCount(K key) const {
  if (!bloom()) return 0;
  return BloomMin(Hash(key));
}

template <typename K>
std::vector<uint8_t> Table<K>::BloomState() const {
  if (!bloom()) return {};
  const size_t bytes = options_.bloom_counters * options_.bloom_counter_bytes;
  std::vector<uint8_t> state(bytes + sizeof(kBloomMagic));
  // Every shard locked shared: no lookup adds sightings meanwhile.
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  for (const auto& s : shards_) locks.emplace_back(s->mu);
  std::memcpy(state.data(), bloom_words_.data(), bytes);
  std::memcpy(state.data() + bytes, kBloomMagic, sizeof(kBloomMagic));
  return state;
}

template <typename K>
bool Table<K>::SetBloomState(const std::vector<uint8_t>& state) {
  if (!bloom()) return false;
  const size_t bytes = options_.bloom_counters * options_.bloom_counter_bytes;
  if (state.size() != bytes + sizeof(kBloomMagic) ||
      std::memcmp(state.data() + bytes, kBloomMagic, sizeof(kBloomMagic)) != 0) {
    return false;
  }
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  std::memcpy(bloom_words_.data(), state.data(), bytes);
  return true;
}

template <typename K>
void Table<K>::EraseAt(Shard& s, uint64_t i) {
  const Entry& e = s.entries[i];
  if (e.row == kNoRow) {
    --s.filtered;
  } else {
    s.free_rows.push_back(e.row);
  }
  if (e.meta_row != kNoRow) s.free_meta.push_back(e.meta_row);
  // With linear probing a slot followed by an empty one ends every probe
  // chain through it, so it can become empty instead of a tombstone.
  if (s.ctrl[(i + 1) & s.mask] == kEmpty) {
    s.ctrl[i] = kEmpty;
  } else {
    s.ctrl[i] = kDeleted;
    ++s.tombstones;
  }
  --s.live;
}

namespace {

template <int D>
inline void CopyFixed(float* dst, const float* src) {
  for (int d = 0; d < D; ++d) dst[d] = src[d];
}

// Copies one row; common widths get an inlined fixed-size copy instead of a
// library call per row.
inline void CopyRow(float* dst, const float* src, int64_t dim) {
  switch (dim) {
    case 4: return CopyFixed<4>(dst, src);
    case 8: return CopyFixed<8>(dst, src);
    case 16: return CopyFixed<16>(dst, src);
    case 32: return CopyFixed<32>(dst, src);
    case 64: return CopyFixed<64>(dst, src);
    case 128: return CopyFixed<128>(dst, src);
    default: std::memcpy(dst, src, static_cast<size_t>(dim) * sizeof(float));
  }
}

inline void PrefetchRow(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(float)); off += 64) {
    __builtin_prefetch(p + off);
  }
}

// Saturating int64 arithmetic for frequencies and versions: they may come
// from a checkpoint (any int64, INT64_MIN included), and a wrapped difference
// would silently keep a stale key (eviction) or never admit one (filter).
inline int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return b > 0 ? INT64_MAX : INT64_MIN;
  return r;
}

inline int64_t SatSub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
  return r;
}

}  // namespace

template <typename K>
int64_t Table<K>::CountFreq(int64_t freq, int64_t count) const {
  const int64_t next = SatAdd(freq, count);
  const int64_t cap = options_.freq_cap;
  // A count already past the cap (restored from a checkpoint) is kept.
  if (cap > 0 && next > cap) return freq > cap ? freq : cap;
  return next;
}

template <typename K>
const float* Table<K>::Resolve(Shard& s, K key, uint64_t h, bool insert, int64_t now,
                               int64_t count, int64_t* admitted, int64_t* skip) {
  // `count` occurrences of the key at once; all of them read the same row.
  // With a filter (DeepRec's rule) a training lookup reads the row only if
  // the key was admitted before it: the lookup whose count reaches the
  // threshold admits the key (so this step's gradient trains its new row)
  // but still reads no_permission_value.
  *skip = 0;
  const int64_t threshold = options_.filter_freq;
  const bool gate = threshold > 1 && (filtering() || bloom());
  const int64_t idx = FindIndex(s, key, h);
  if (idx >= 0) {
    Entry& e = s.entries[idx];
    int64_t* m = Meta(s, e);
    if (insert && m) m[kFreq] = CountFreq(m[kFreq], count);
    if (e.row != kNoRow) return s.values.Row(e.row);
    // Counted by the counter filter, not admitted yet.
    if (!insert) return no_permission_row_.data();
    m[kVersion] = now;  // last seen
    if (m[kFreq] >= threshold) {
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
      freq = static_cast<int64_t>(std::min<uint64_t>(BloomAdd(h), INT64_MAX));
      if (freq >= threshold) break;
    }
    if (freq < threshold) return no_permission_row_.data();
    freq = SatAdd(freq, count - seen);
  } else if (filtering()) {
    admit = count >= threshold;
  }
  const Entry& e = s.entries[InsertNew(s, key, h, admit)];
  if (int64_t* m = Meta(s, e)) {
    m[kFreq] = CountFreq(0, freq);
    m[kVersion] = now;  // first seen; Apply stamps updates
  }
  if (admit) ++*admitted;
  if (gate || !admit) return no_permission_row_.data();
  return s.values.Row(e.row);
}

template <typename K>
template <bool kCounted>
int64_t Table<K>::LookupImpl(int shard, const K* keys, const uint64_t* hashes,
                             const int64_t* order, const int32_t* counts, int64_t n,
                             bool insert, float* out, int32_t* skips) {
  Shard& s = *shards_[shard];
  std::unique_lock<std::shared_mutex> wlock(s.mu, std::defer_lock);
  std::shared_lock<std::shared_mutex> rlock(s.mu, std::defer_lock);
  if (insert) {
    wlock.lock();
  } else {
    rlock.lock();
  }
  // Keys go in blocks: resolve a block (its index slots were prefetched
  // while the previous block was resolved) and prefetch each row found and
  // its output, then copy the block's rows, by then on their way to the
  // cache.
  constexpr int64_t kBlock = 16;
  const float* src[kBlock];
  int64_t inserted = 0;
  auto prefetch_slots = [&](int64_t begin, int64_t end) {
    if (s.ctrl.empty()) return;
    for (int64_t j = begin; j < end; ++j) {
      const uint64_t p = hashes[j] & s.mask;
      __builtin_prefetch(&s.ctrl[p]);
      __builtin_prefetch(&s.entries[p]);
    }
  };
  const int64_t now = SatAdd(LatestStep(), 1);  // the step this lookup belongs to
  if (!kCounted && insert && options_.filter_freq > 1 && n > 1) {
    // With a filter, equal keys of the batch are resolved once with their
    // count, so that all their occurrences read the same value.
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(n) * 2) cap <<= 1;
    std::vector<int64_t> slot(cap, -1);
    std::vector<int64_t> first, count;
    std::vector<int64_t> which(n);
    for (int64_t j = 0; j < n; ++j) {
      uint64_t p = hashes[j] & (cap - 1);
      while (slot[p] >= 0 && keys[first[slot[p]]] != keys[j]) p = (p + 1) & (cap - 1);
      if (slot[p] < 0) {
        slot[p] = static_cast<int64_t>(first.size());
        first.push_back(j);
        count.push_back(0);
      }
      which[j] = slot[p];
      ++count[slot[p]];
    }
    std::vector<const float*> rows(first.size());
    for (size_t u = 0; u < first.size(); ++u) {
      int64_t skip;
      rows[u] = Resolve(s, keys[first[u]], hashes[first[u]], true, now, count[u], &inserted,
                        &skip);
    }
    for (int64_t j = 0; j < n; ++j) CopyRow(out + order[j] * dim_, rows[which[j]], dim_);
    return inserted;
  }
  prefetch_slots(0, std::min(n, kBlock));
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    prefetch_slots(e, std::min(n, e + kBlock));
    for (int64_t j = b; j < e; ++j) {
      int64_t skip;
      src[j - b] = Resolve(s, keys[j], hashes[j], insert, now,
                           kCounted ? counts[order[j]] : 1, &inserted, &skip);
      if (kCounted) skips[order[j]] = static_cast<int32_t>(skip);
      PrefetchRow(src[j - b], dim_);
      __builtin_prefetch(out + order[j] * dim_, 1);
    }
    for (int64_t j = b; j < e; ++j) CopyRow(out + order[j] * dim_, src[j - b], dim_);
  }
  return inserted;
}

template <typename K>
int64_t Table<K>::Lookup(int shard, const K* keys, const uint64_t* hashes,
                         const int64_t* order, int64_t n, bool insert,
                         float* out) {
  return LookupImpl<false>(shard, keys, hashes, order, nullptr, n, insert, out, nullptr);
}

template <typename K>
int64_t Table<K>::LookupCounted(int shard, const K* keys, const uint64_t* hashes,
                                const int64_t* order, const int32_t* counts, int64_t n,
                                bool insert, float* out, int32_t* skips) {
  return LookupImpl<true>(shard, keys, hashes, order, counts, n, insert, out, skips);
}

template <typename K>
int Table<K>::AddSlot(const std::string& name, int64_t width, float init) {
  if (width <= 0) throw std::invalid_argument("slot width must be positive");
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  std::lock_guard<std::mutex> specs_lock(slot_specs_mu_);
  for (size_t j = 0; j < slot_specs_.size(); ++j) {
    if (slot_specs_[j].name == name) {
      if (slot_specs_[j].width != width) {
        throw std::invalid_argument("slot '" + name + "' exists with width " +
                                    std::to_string(slot_specs_[j].width));
      }
      slot_specs_[j].init = init;
      return static_cast<int>(j);
    }
  }
  // Allocate everything first, then commit with moves that cannot fail, so
  // that running out of memory leaves the table as it was.
  std::vector<ChunkedArena<float>> arenas;
  arenas.reserve(shards_.size());
  for (auto& sp : shards_) {
    arenas.emplace_back(width);
    arenas.back().EnsureCapacity(sp->next_row, init);
    sp->slots.reserve(sp->slots.size() + 1);
  }
  slot_specs_.reserve(slot_specs_.size() + 1);
  for (size_t i = 0; i < shards_.size(); ++i) shards_[i]->slots.push_back(std::move(arenas[i]));
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
                      const std::vector<int>& slot_ids,
                      const std::vector<int64_t>& slot_widths) {
  if (n == 0) return;  // e.g. a promotion step with nothing to copy
  int64_t total_width = 0;
  for (int64_t w : slot_widths) total_width += w;
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = Hash(keys[i]);
    Shard& s = *shards_[ShardOf(h)];
    int64_t idx = FindIndex(s, keys[i], h);
    const bool existed = idx >= 0;
    if (idx < 0) idx = static_cast<int64_t>(InsertNew(s, keys[i], h, /*admit=*/true));
    if (s.entries[idx].row == kNoRow) Admit(s, static_cast<uint64_t>(idx));
    const Entry& e = s.entries[idx];
    std::copy(values + i * dim_, values + (i + 1) * dim_, s.values.Row(e.row));
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
      std::copy(src, src + slot_widths[j], s.slots[slot_ids[j]].Row(e.row));
      src += slot_widths[j];
    }
  }
}

template <typename K>
void Table<K>::ImportFiltered(const K* keys, const int64_t* freqs, const int64_t* versions,
                              int64_t n) {
  if (n == 0 || !filtering() || bloom()) return;  // only the counter filter keeps such keys
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = Hash(keys[i]);
    Shard& s = *shards_[ShardOf(h)];
    int64_t idx = FindIndex(s, keys[i], h);
    if (idx >= 0 && s.entries[idx].row != kNoRow) continue;  // stays admitted
    if (idx < 0) idx = static_cast<int64_t>(InsertNew(s, keys[i], h, /*admit=*/false));
    int64_t* m = Meta(s, s.entries[idx]);
    m[kFreq] = freqs[i];
    m[kVersion] = versions[i];
  }
}

template <typename K>
int64_t Table<K>::Evict(int64_t now, int64_t steps_to_live, float l2_threshold) {
  if (now < 0) now = LatestStep();
  const bool by_step = steps_to_live >= 0 && options_.track_meta;
  int64_t erased = 0;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    std::unique_lock<std::shared_mutex> lock(s.mu);
    for (uint64_t i = 0; i < s.ctrl.size(); ++i) {
      if (s.ctrl[i] & 0x80) continue;
      const Entry& e = s.entries[i];
      const int64_t* m = Meta(s, e);
      bool evict = by_step && SatSub(now, m[kVersion]) > steps_to_live;
      if (!evict && l2_threshold >= 0 && e.row != kNoRow) {
        const float* v = s.values.Row(e.row);
        // DeepRec's L2WeightEvict: half the squared L2 norm (tf.nn.l2_loss
        // of the row) against the threshold.
        double sq = 0;
        for (int64_t d = 0; d < dim_; ++d) sq += static_cast<double>(v[d]) * v[d];
        evict = 0.5 * sq < static_cast<double>(l2_threshold);
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
  const int64_t idx = FindIndex(s, key, h);
  if (idx < 0) return false;
  EraseAt(s, static_cast<uint64_t>(idx));
  return true;
}

template <typename K>
void Table<K>::ResetShard(Shard& s) {
  s.ctrl.clear();
  s.ctrl.shrink_to_fit();
  s.entries.clear();
  s.entries.shrink_to_fit();
  s.mask = 0;
  s.live = 0;
  s.tombstones = 0;
  s.values.Clear();
  for (auto& a : s.slots) a.Clear();
  s.next_row = 0;
  s.free_rows.clear();
  s.free_rows.shrink_to_fit();
  s.meta.Clear();
  s.next_meta = 0;
  s.free_meta.clear();
  s.free_meta.shrink_to_fit();
  s.filtered = 0;
}

template <typename K>
void Table<K>::SwapContents(Table& other) {
  if (other.dim_ != dim_ || other.shards_.size() != shards_.size() ||
      other.bloom_words_.size() != bloom_words_.size() ||
      other.options_.bloom_counter_bytes != options_.bloom_counter_bytes ||
      other.options_.track_meta != options_.track_meta) {
    throw std::invalid_argument("SwapContents: the tables differ in shape");
  }
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  for (auto& s : other.shards_) locks.emplace_back(s->mu);
  std::scoped_lock specs_lock(slot_specs_mu_, other.slot_specs_mu_);
  for (size_t j = 0; j < slot_specs_.size(); ++j) {
    if (j >= other.slot_specs_.size() || other.slot_specs_[j].name != slot_specs_[j].name ||
        other.slot_specs_[j].width != slot_specs_[j].width) {
      throw std::invalid_argument("the table's optimizer slots changed during the import");
    }
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    Shard& a = *shards_[i];
    Shard& b = *other.shards_[i];
    std::swap(a.ctrl, b.ctrl);
    std::swap(a.entries, b.entries);
    std::swap(a.mask, b.mask);
    std::swap(a.live, b.live);
    std::swap(a.tombstones, b.tombstones);
    std::swap(a.values, b.values);
    std::swap(a.slots, b.slots);
    std::swap(a.next_row, b.next_row);
    std::swap(a.free_rows, b.free_rows);
    std::swap(a.meta, b.meta);
    std::swap(a.next_meta, b.next_meta);
    std::swap(a.free_meta, b.free_meta);
    std::swap(a.filtered, b.filtered);
  }
  std::swap(bloom_words_, other.bloom_words_);
  std::swap(slot_specs_, other.slot_specs_);
  std::swap(default_values_, other.default_values_);
  std::swap(default_value_dim_, other.default_value_dim_);
  RaiseLatestStep(other.LatestStep());
}

template <typename K>
void Table<K>::Clear() {
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  for (auto& s : shards_) locks.emplace_back(s->mu);
  for (auto& s : shards_) ResetShard(*s);
  std::fill(bloom_words_.begin(), bloom_words_.end(), 0);
}

template <typename K>
bool Table<K>::Find(K key, std::vector<float>* value, int64_t* freq,
                    int64_t* version) const {
  const uint64_t h = Hash(key);
  const Shard& s = *shards_[ShardOf(h)];
  std::shared_lock<std::shared_mutex> lock(s.mu);
  const int64_t idx = FindIndex(s, key, h);
  if (idx < 0) return false;
  const Entry& e = s.entries[idx];
  if (e.row == kNoRow) {
    value->clear();
  } else {
    const float* v = s.values.Row(e.row);
    value->assign(v, v + dim_);
  }
  const int64_t* m = Meta(s, e);
  *freq = m ? m[kFreq] : 0;
  *version = m ? m[kVersion] : 0;
  return true;
}

template class Table<int64_t>;
template class Table<int32_t>;

}  // namespace kv
}  // namespace kre
