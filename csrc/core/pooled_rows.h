// Copyright keras_rec_emb authors. Apache-2.0.
// The pooled lookup's kernel without TensorFlow: one feature's kept ids, in
// batch order and not deduplicated, looked up and combined straight into
// the output, block by block. The TensorFlow kernels (csrc/kernels/pooled_lookup.h: the
// group lookup's pooled features, the stacked pooled lookup) and the JAX
// binding's group inference lookup (csrc/jax/pooled_handlers.cc) both run it.
//
// A table that reads in batch order (kv::Table::PrefersOrderedLookup: rows
// in DRAM, no admission filter, not too large) has each block's rows found
// with kv::Table::OrderedReader (row pointers, prefetched) and combined from
// the table by CombinePooledRows. Any other table (a filter, a file tier, a
// large table) has a chunk of ids grouped by shard and looked up shard by
// shard into a row buffer (kv::Table::Lookup without insert), then combined
// alike. CombinePooledRows's outputs are bit-identical to the deduplicating
// path's weighted loop (CombineRows, csrc/kernels/distinct_lookup.cc) with
// weights of 1, and CombineRows runs it for unweighted ids.
#ifndef KRE_CORE_POOLED_ROWS_H_
#define KRE_CORE_POOLED_ROWS_H_

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kv/partition.h"
#include "kv/shard_ops.h"
#include "kv/table.h"

namespace kre {

enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

// "sum", "mean" or "sqrtn" into *c; false for any other name.
inline bool ParseCombiner(std::string_view name, Combiner* c) {
  if (name == "sum") {
    *c = kSum;
  } else if (name == "mean") {
    *c = kMean;
  } else if (name == "sqrtn") {
    *c = kSqrtn;
  } else {
    return false;
  }
  return true;
}

// 1 / the combiner's denominator of a row of n unweighted ids (0 when n is
// 0), summed as CombinerScale sums weights of 1.
inline float UnweightedScale(Combiner c, int64_t n) {
  float denom = 0;
  for (int64_t k = 0; k < n; ++k) denom += 1.0f;
  if (c == kSqrtn) denom = std::sqrt(denom);
  return denom == 0 ? 0.0f : 1.0f / denom;
}

// CombinePooled's padded form: for rows of at most this many ids, and its
// pad row (-0.0f, as wide as the widest D it is compiled for).
constexpr int64_t kPaddedCombineLen = 8;
alignas(64) constexpr std::array<float, 64> kNegativeZeros = [] {
  std::array<float, 64> z{};
  for (float& x : z) x = -0.0f;
  return z;
}();

// Whether CombinePooledRows pads `rows` rows of `ids` ids in all, none
// longer than max_len: when rows are short and the padding at most doubles
// the rows added (widths without a CombinePooled<D> ignore it).
inline bool PadPooledRows(int64_t max_len, int64_t rows, int64_t ids) {
  return max_len <= kPaddedCombineLen && max_len * rows <= 2 * ids;
}

// PooledRows' combine of rows [b0, b1) for a width D known at compile
// time: row b's ids' rows are rows[splits[b] - j0], ...; each output row is
// summed in registers and stored once, with
// CombineRows' operations in its order (1 * x for one id; 0 + x_0 + x_1 +
// ... then * 1 / n or 1 / sqrt(n) for several; zeros for none), so the
// results are bit-identical.
//
// With `padded` (rows[pad] is a row of -0.0f and no row has more than
// max_len ids), every row adds max_len rows, its own then the pad row, so
// no branch depends on a row's length (one that does mispredicts about once
// a row when lengths vary, as 1-5 ids do). It is the same sum: x + -0.0 ==
// x for every float x, and the sum starts at -0.0 for one id (-0.0 + x ==
// 1 * x) and at +0.0 otherwise.
template <int D>
void CombinePooled(const int64_t* splits, int64_t j0, int64_t b0, int64_t b1,
                   const float* const* rows, bool padded, int64_t pad, int64_t max_len,
                   Combiner comb, float* out, int64_t stride) {
  static_assert(D % 4 == 0, "rows are summed 4 floats at a time");
  static_assert(D <= kNegativeZeros.size(), "the pad row is as wide as every row");
  constexpr int V = D / 4;
  // Output rows that are whole aligned cache lines are streamed: a store
  // that misses would read its line first (its write is all that line
  // gets), and the F features' columns of a concatenated output leave every
  // line cold (in profiles, those reads were most of this loop's time).
  const bool stream = kv::StreamableRows(out, D, stride);
  auto store = [stream](float* o, const __m128* acc) {
    if (stream) {
      for (int v = 0; v < V; ++v) _mm_stream_ps(o + 4 * v, acc[v]);
    } else {
      for (int v = 0; v < V; ++v) _mm_storeu_ps(o + 4 * v, acc[v]);
    }
  };
  __m128 acc[V];
  if (padded) {
    float scale[kPaddedCombineLen + 1];  // by ids in the row; 1 for 0 and 1 id
    for (int64_t n = 0; n <= max_len; ++n) {
      scale[n] = n >= 2 && comb != kSum ? UnweightedScale(comb, n) : 1.0f;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = splits[b] - j0, n = splits[b + 1] - splits[b];
      const __m128 start = _mm_set1_ps(n == 1 ? -0.0f : 0.0f);
      for (int v = 0; v < V; ++v) acc[v] = start;
      for (int64_t k = 0; k < max_len; ++k) {
        const float* row = rows[k < n ? k0 + k : pad];
        for (int v = 0; v < V; ++v) acc[v] = _mm_add_ps(acc[v], _mm_loadu_ps(row + 4 * v));
      }
      if (comb != kSum) {
        const __m128 c = _mm_set1_ps(scale[n]);
        for (int v = 0; v < V; ++v) acc[v] = _mm_mul_ps(acc[v], c);
      }
      store(out + b * stride, acc);
    }
    return;
  }
  const __m128 one = _mm_set1_ps(1.0f);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = splits[b] - j0, k1 = splits[b + 1] - j0;
    if (k1 == k0 + 1) {
      for (int v = 0; v < V; ++v) acc[v] = _mm_mul_ps(one, _mm_loadu_ps(rows[k0] + 4 * v));
    } else {
      for (int v = 0; v < V; ++v) acc[v] = _mm_setzero_ps();
      for (int64_t k = k0; k < k1; ++k) {
        for (int v = 0; v < V; ++v) acc[v] = _mm_add_ps(acc[v], _mm_loadu_ps(rows[k] + 4 * v));
      }
      if (comb != kSum) {
        const float c = UnweightedScale(comb, k1 - k0);
        if (c != 1.0f) {
          for (int v = 0; v < V; ++v) acc[v] = _mm_mul_ps(acc[v], _mm_set1_ps(c));
        }
      }
    }
    store(out + b * stride, acc);
  }
}

// CombinePooled for any width (the common ones with D fixed at compile
// time; the others never padded: their loop ignores `padded`).
inline void CombinePooledRows(int64_t dim, const int64_t* splits, int64_t j0, int64_t b0,
                              int64_t b1, const float* const* rows, bool padded, int64_t pad,
                              int64_t max_len, Combiner comb, float* out, int64_t stride) {
  switch (dim) {
#define KRE_COMBINE_CASE(D) \
  case D:                   \
    return CombinePooled<D>(splits, j0, b0, b1, rows, padded, pad, max_len, comb, out, stride);
    KRE_COMBINE_CASE(4)
    KRE_COMBINE_CASE(8)
    KRE_COMBINE_CASE(16)
    KRE_COMBINE_CASE(32)
    KRE_COMBINE_CASE(64)
#undef KRE_COMBINE_CASE
    default:
      break;
  }
  for (int64_t b = b0; b < b1; ++b) {
    float* o = out + b * stride;
    const int64_t k0 = splits[b] - j0, k1 = splits[b + 1] - j0;
    if (k1 == k0 + 1) {
      const float* row = rows[k0];
      for (int64_t d = 0; d < dim; ++d) o[d] = 1.0f * row[d];
      continue;
    }
    std::fill(o, o + dim, 0.0f);
    for (int64_t k = k0; k < k1; ++k) {
      const float* row = rows[k];
      for (int64_t d = 0; d < dim; ++d) o[d] += 1.0f * row[d];
    }
    if (comb == kSum) continue;
    const float c = UnweightedScale(comb, k1 - k0);
    if (c != 1.0f) {
      for (int64_t d = 0; d < dim; ++d) o[d] *= c;
    }
  }
}

// CombinePooledRows of rows [b0, b1) whose ids' rows are base + index[j] *
// dim (j from splits[b0] on: distinct rows through an inverse, or a dense
// matrix through ids); `rows` has room for their splits[b1] - splits[b0]
// pointers and the pad row's. The streamed stores are fenced on return.
template <typename I>
void CombineIndexedRows(int64_t dim, const int64_t* splits, int64_t b0, int64_t b1,
                        const float* base, const I* index, Combiner comb, float* out,
                        int64_t stride, const float** rows) {
  const int64_t j0 = splits[b0], n = splits[b1] - j0;
  int64_t max_len = 0;
  for (int64_t b = b0; b < b1; ++b) max_len = std::max(max_len, splits[b + 1] - splits[b]);
  for (int64_t k = 0; k < n; ++k) rows[k] = base + static_cast<int64_t>(index[j0 + k]) * dim;
  rows[n] = kNegativeZeros.data();
  CombinePooledRows(dim, splits, j0, b0, b1, rows, PadPooledRows(max_len, b1 - b0, n), n, max_len,
                    comb, out, stride);
  kv::StreamFence();
}

// Kept ids per block of a feature read in batch order: the block's ids stay
// in L1, its rows in L2.
constexpr int64_t kPooledBlockIds = 1024;
// Ids per chunk of a feature looked up shard by shard: enough per shard for
// each shard's lookup to stay within its own memory a while.
constexpr int64_t kPooledChunkIds = 1 << 16;

// One feature on the pooled path.
struct PooledFeature {
  const int64_t* kept;    // its kept ids (ids to look up), row after row
  const int64_t* splits;  // row b's ids: kept[splits[b] .. splits[b + 1])
  int64_t dim;
  int64_t default_id;  // >= 0: read by an empty row (else zeros)
  Combiner combiner;
  float* out;  // row b's output at out + b * stride
  int64_t stride;
  int feature, table;  // for messages
};

// acc[d] += s * x[d] for d < dim (D: dim when known at compile time, else
// 0); the backward sums of the TensorFlow group op and of the JAX handlers.
// The gradient and the sums are both float arrays, so the compiler keeps a
// fixed-width loop scalar (they might overlap); a width of whole vectors is
// summed 4 floats at a time, with the scalar loop's operations (a multiply,
// then an add, per element): bit-identical.
template <int D>
inline void AddScaled(float* acc, float s, const float* x, int64_t dim) {
  if constexpr (D > 0 && D % 4 == 0) {
    const __m128 sv = _mm_set1_ps(s);
    for (int v = 0; v < D / 4; ++v) {
      _mm_storeu_ps(acc + 4 * v,
                    _mm_add_ps(_mm_loadu_ps(acc + 4 * v), _mm_mul_ps(sv, _mm_loadu_ps(x + 4 * v))));
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) acc[d] += s * x[d];
  }
}

// Rows of a buffer for a feature read shard by shard: a chunk holds
// kPooledChunkIds ids, or one row (with its default id) of max_len ids.
inline int64_t PooledBufferRows(int64_t kept, int64_t rows, int64_t max_len) {
  return std::min(kept + rows, std::max(kPooledChunkIds, max_len) + 1);
}

namespace pooled_internal {

// Scratch of a block of one feature's rows, when its keys are not the kept
// ids as they are (an int32 table, or rows filled with the default id).
template <typename K>
struct Block {
  std::vector<K> keys;
  std::vector<int64_t> splits;
  std::vector<const float*> rows;  // the rows found, and the pad row
};

// The rows of in[0, n), shard by shard into `buffer` (room for n rows of dim
// floats); their pointers into rows[0, n).
template <typename K>
void FindByShard(kv::Table<K>& table, const K* in, int64_t n, int64_t dim, float* buffer,
                 const float** rows) {
  // One block: this runs on one of the op's units already.
  const kv::Partitioned<K> p = kv::Partition(table, in, n, 1, [](int num_blocks, auto&& fn) {
    for (int b = 0; b < num_blocks; ++b) fn(b);
  });
  for (int s = 0; s < table.num_shards(); ++s) {
    const int64_t b = p.offsets[s], m = p.offsets[s + 1] - b;
    if (m > 0) {
      table.Lookup(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, m,
                   /*insert=*/false, buffer);
    }
  }
  for (int64_t u = 0; u < n; ++u) rows[u] = buffer + u * dim;
}

}  // namespace pooled_internal

// What PooledRowsOf found wrong: nothing (ok), or an id of row `row` that
// does not fit an int32 table's keys.
struct PooledBadId {
  bool ok = true;
  int64_t id = 0, row = 0;
};

// Rows [begin, end) of feature `pf` from `table`: in blocks of about
// kPooledBlockIds ids read in batch order when `buffer` is null, else in
// chunks of kPooledChunkIds ids read shard by shard into `buffer` (rows of
// PooledBufferRows). Stops at an id that does not fit an int32 table's keys
// and returns it.
template <typename K>
PooledBadId PooledRowsOf(kv::Table<K>& table, const PooledFeature& pf, int64_t begin, int64_t end,
                         float* buffer) {
  thread_local pooled_internal::Block<K> blk;
  const int64_t* kept = pf.kept;
  const int64_t* splits = pf.splits;
  const int64_t def = pf.default_id;
  std::optional<typename kv::Table<K>::OrderedReader> reader;
  if (buffer == nullptr) reader.emplace(table);
  const int64_t max_ids = buffer == nullptr ? kPooledBlockIds : kPooledChunkIds;
  for (int64_t b0 = begin; b0 < end;) {
    // Rows [b0, b1): as many as hold max_ids keys (at least one row),
    // counting a default id for each row when empty rows may read one.
    const int64_t j0 = splits[b0];
    const int64_t per_row_fill = def >= 0 ? 1 : 0;
    int64_t b1 = b0 + 1;
    int64_t max_len = splits[b1] - j0, min_len = max_len;
    while (b1 < end && splits[b1 + 1] - j0 + per_row_fill * (b1 + 1 - b0) <= max_ids) {
      const int64_t n = splits[b1 + 1] - splits[b1];
      max_len = std::max(max_len, n);
      min_len = std::min(min_len, n);
      ++b1;
    }
    const int64_t rows = b1 - b0;
    int64_t n = splits[b1] - j0;
    // The block's keys: the kept ids where they are, or (an int32 table,
    // or an empty row to fill with the default id) a copy in blk.
    const K* keys;
    const int64_t* sp = splits;
    int64_t first = b0, base = j0;
    const bool fill = def >= 0 && min_len == 0;
    if (std::is_same_v<K, int64_t> && !fill) {
      keys = reinterpret_cast<const K*>(kept + j0);
    } else {
      blk.keys.resize(n + rows);
      blk.splits.resize(rows + 1);
      K* k = blk.keys.data();
      int64_t m = 0;
      blk.splits[0] = 0;
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
          if constexpr (!std::is_same_v<K, int64_t>) {
            if (kept[j] > std::numeric_limits<K>::max() ||
                kept[j] < std::numeric_limits<K>::min()) {
              return {false, kept[j], b};
            }
          }
          k[m++] = static_cast<K>(kept[j]);
        }
        if (fill && splits[b + 1] == splits[b]) k[m++] = static_cast<K>(def);
        blk.splits[b - b0 + 1] = m;
      }
      if (fill) max_len = std::max<int64_t>(max_len, 1);
      n = m;
      keys = k;
      sp = blk.splits.data();
      first = 0;
      base = 0;
    }
    // One slot more: the pad row.
    if (static_cast<int64_t>(blk.rows.size()) < n + 1) blk.rows.resize(n + 1);
    if (reader) {
      reader->Find(keys, n, blk.rows.data(), /*read_later=*/true);
    } else {
      pooled_internal::FindByShard(table, keys, n, pf.dim, buffer, blk.rows.data());
    }
    blk.rows[n] = kNegativeZeros.data();
    CombinePooledRows(pf.dim, sp, base, first, first + rows, blk.rows.data(),
                      PadPooledRows(max_len, rows, n), n, max_len, pf.combiner,
                      pf.out + (b0 - first) * pf.stride, pf.stride);
    b0 = b1;
  }
  kv::StreamFence();  // the streamed stores are ordered before the op completes
  return {};
}

}  // namespace kre

#endif  // KRE_CORE_POOLED_ROWS_H_
