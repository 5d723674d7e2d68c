// Copyright keras_rec_emb authors. Apache-2.0.
// What the pooled lookup kernels share (the group lookup: group_config.cc,
// group_forward.cc, group_backward.cc; the stacked pooled lookup:
// stacked_lookup_kernels.cc): the combiners, a table of either key dtype
// resolved from its handle, and CombinePooledRows, the pooled path's
// combine of rows given as pointers (pooled_lookup.h), bit-identical to the
// deduplicating path's CombineRows (distinct_lookup.cc) for unweighted ids.
#ifndef KRE_KERNELS_POOLED_COMBINE_H_
#define KRE_KERNELS_POOLED_COMBINE_H_

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/table_resource.h"
#include "kv/shard_ops.h"

namespace kre {

enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

// "sum", "mean" or "sqrtn" into *c; false for any other name.
inline bool ParseCombiner(const std::string& name, Combiner* c) {
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

// A table of either key dtype.
struct TableSlot {
  tf::core::RefCountPtr<TableResource<int64_t>> t64;
  tf::core::RefCountPtr<TableResource<int32_t>> t32;
  int num_shards() const { return t64 ? t64->table().num_shards() : t32->table().num_shards(); }
  bool filtered() const {
    return t64 ? t64->table().filtering() || t64->table().bloom()
               : t32->table().filtering() || t32->table().bloom();
  }
  const float* NoPermissionRow() const {
    return t64 ? t64->table().NoPermissionRow() : t32->table().NoPermissionRow();
  }
  uint64_t Hash(int64_t id) const {
    return t64 ? kv::Table<int64_t>::Hash(id) : kv::Table<int32_t>::Hash(static_cast<int32_t>(id));
  }
  bool PrefersOrderedLookup(int64_t n) const {
    return t64 ? t64->table().PrefersOrderedLookup(n) : t32->table().PrefersOrderedLookup(n);
  }
};

// Resolves input `input` of ctx, the handle of table `t` (for messages),
// into *slot, checking its key dtype and dim against what the op was told.
inline absl::Status ResolveTable(OpKernelContext* ctx, int input, int t, tf::DataType key_dtype,
                                 int64_t dim, TableSlot* slot) {
  tf::core::RefCountPtr<TableResourceBase> base;
  TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, input), &base));
  if (base->key_dtype() != key_dtype) {
    return errors::InvalidArgument("table ", t, " has key dtype ",
                                   tf::DataTypeString(base->key_dtype()), " but the op was told ",
                                   tf::DataTypeString(key_dtype));
  }
  if (base->dim() != dim) {
    return errors::InvalidArgument("table ", t, " has dim ", base->dim(),
                                   " but the op expects dim ", dim);
  }
  if (key_dtype == tf::DT_INT64) {
    auto* typed = dynamic_cast<TableResource<int64_t>*>(base.get());
    if (typed == nullptr) return errors::Internal("table ", t, " is not int64-keyed");
    typed->Ref();
    slot->t64.reset(typed);
  } else {
    auto* typed = dynamic_cast<TableResource<int32_t>*>(base.get());
    if (typed == nullptr) return errors::Internal("table ", t, " is not int32-keyed");
    typed->Ref();
    slot->t32.reset(typed);
  }
  return absl::OkStatus();
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

}  // namespace kre

#endif  // KRE_KERNELS_POOLED_COMBINE_H_
