// Copyright keras_rec_emb authors. Apache-2.0.
//
// Helpers of the batched shard operations (Table::Lookup, Apply): row
// copies, prefetches, saturating metadata arithmetic, and the grouping of
// equal items of one batch.
#ifndef KRE_KV_SHARD_OPS_H_
#define KRE_KV_SHARD_OPS_H_

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kv/shard_index.h"

namespace kre {
namespace kv {

template <int D>
KRE_KV_INLINE void CopyFixed(float* dst, const float* src) {
  // One constant-size memcpy: whole-vector moves (a loop of float copies
  // stays scalar, as dst and src might overlap).
  __builtin_memcpy(dst, src, D * sizeof(float));
}

// CopyFixed<D> for the D of kWidths equal to dim, else a memcpy.
template <int... kWidths>
KRE_KV_INLINE void CopyRowOf(float* dst, const float* src, int64_t dim) {
  if (!((dim == kWidths && (CopyFixed<kWidths>(dst, src), true)) || ...)) {
    std::memcpy(dst, src, static_cast<size_t>(dim) * sizeof(float));
  }
}

// Copies one row; common widths get an inlined fixed-size copy instead of a
// library call per row.
KRE_KV_INLINE void CopyRow(float* dst, const float* src, int64_t dim) {
  CopyRowOf<4, 8, 16, 32, 64, 128>(dst, src, dim);
}

// Whether rows of `dim` floats written `stride` floats apart from `out` are
// each whole, aligned cache lines, which StreamRow may write.
inline bool StreamableRows(const float* out, int64_t dim, int64_t stride) {
#if defined(__SSE2__)
  return dim % 16 == 0 && stride % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
#else
  return false;
#endif
}

// Copies a row of whole cache lines (see StreamableRows) with non-temporal
// stores: a store that misses does not read its line first (an output's
// lines are cold, and the row is all that is written to them). Writers
// call StreamFence() before their output is read by another thread.
KRE_KV_INLINE void StreamRow(float* dst, const float* src, int64_t dim) {
#if defined(__SSE2__)
  for (int64_t d = 0; d < dim; d += 4) _mm_stream_ps(dst + d, _mm_loadu_ps(src + d));
#else
  CopyRow(dst, src, dim);
#endif
}

inline void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Prefetches every cache line of a row (also the last one of a row that
// does not start on a line). kLocality is __builtin_prefetch's: 3 (into
// L1, the default) for a row read a few keys later; 2 (into L2) for one
// read after a whole block of lookups, when L1 would have dropped it.
template <int kLocality = 3>
KRE_KV_INLINE void PrefetchRow(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(float));
  __builtin_prefetch(p, 0, kLocality);
  __builtin_prefetch(p + bytes - 1, 0, kLocality);
  for (int64_t off = 64; off < bytes - 1; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// Metadata words that training lookups update under a shared shard lock
// (frequency and change epoch, see Table::LookupOrdered): read and written
// atomically (relaxed) by whoever may hold the lock shared; holders of the
// exclusive lock may use plain accesses.
KRE_KV_INLINE int64_t LoadRelaxed(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
KRE_KV_INLINE void StoreRelaxed(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

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

// Groups up to n items of one batch by equality: Group(h, same) returns the
// group of an item with hash h, `same(g)` telling whether it equals group
// g's first item; groups are numbered 0, 1, ... in first-seen order.
class BatchGroups {
 public:
  explicit BatchGroups(int64_t n) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(n) * 2) cap <<= 1;
    slots_.assign(cap, -1);
  }
  template <typename Same>
  int64_t Group(uint64_t h, Same&& same, bool* created) {
    const uint64_t i =
        Probe(h, slots_.size() - 1, [&](uint64_t j) { return slots_[j] < 0 || same(slots_[j]); });
    *created = slots_[i] < 0;
    if (*created) slots_[i] = count_++;
    return slots_[i];
  }
  // Prefetches the home slot of hash h: a caller that knows the hashes of
  // its next items issues this a few items ahead, so that Group's first
  // load does not wait on the cache (the slots of a batch of a few
  // thousand ids fill L2, not L1).
  void Prefetch(uint64_t h) const { __builtin_prefetch(slots_.data() + (h & (slots_.size() - 1))); }
  int64_t size() const { return count_; }

 private:
  std::vector<int64_t> slots_;
  int64_t count_ = 0;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_SHARD_OPS_H_
