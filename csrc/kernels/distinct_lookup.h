// Copyright keras_rec_emb authors. Apache-2.0.
// The group lookup's deduplicating path (see group_forward.cc for which
// features take it): per parameter, the distinct ids of all its features
// (each id's index among them is its `inverse`), for a table grouped by
// shard and each looked up once, counted as often as it occurs; then each
// feature's rows combined from its parameter's distinct rows. The backward
// (group_backward.cc) reuses the partition and lookup to differentiate a
// max_norm clip, and the scales below.
#ifndef KRE_KERNELS_DISTINCT_LOOKUP_H_
#define KRE_KERNELS_DISTINCT_LOOKUP_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/distinct_ids.h"
#include "kernels/group_config.h"
#include "kernels/pooled_combine.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {

// The distinct ids one parameter is read with, and for a table their rows.
struct ParamIds {
  std::vector<int64_t> uniq;     // distinct ids (table keys in the key dtype)
  std::vector<uint64_t> hashes;  // their hashes
  std::vector<int32_t> counts;   // occurrences in the batch
  // Tables: the distinct keys grouped by shard (in the table's key dtype)
  // and their rows [U, dim].
  kv::Partitioned<int64_t> by_shard64;
  kv::Partitioned<int32_t> by_shard32;
  // From TensorFlow's allocator (a pool: a per-step buffer of this size
  // from malloc took fresh pages, zeroed by the kernel, every step).
  Tensor rows_buffer;
  float* rows = nullptr;
};

// Deduplicates parameter p's ids into *ids (writing each of its features'
// inverse) and, for a table, groups the distinct keys by shard.
void DedupeParam(const GroupConfig& cfg, const std::vector<TableSlot>& tables, int p,
                 std::vector<Feature>* features, ParamIds* ids);

// Groups table t's distinct keys ids->uniq (their hashes in ids->hashes) by
// shard.
void PartitionDistinct(const TableSlot& table, ParamIds* ids);

// Sizes table t's row buffer for up to n distinct keys (on the op's own
// thread, before the parallel units).
absl::Status PrepareRows(OpKernelContext* ctx, const GroupConfig& cfg, int t, int64_t n,
                         ParamIds* ids);

// Reads the rows of table t's distinct keys of shard sh (PrepareRows
// first); with `insert` (training) each counts as often as it occurs.
void LookupShard(const std::vector<TableSlot>& tables, int t, int sh, bool insert, ParamIds* ids);

// LookupShard for every shard of the wanted tables, one unit per (table,
// shard).
absl::Status LookupDistinct(OpKernelContext* ctx, const GroupConfig& cfg,
                            const std::vector<TableSlot>& tables, std::vector<ParamIds>* params,
                            bool insert, const std::vector<bool>& wanted);

// Writes rows [begin, end) of feature f's output from its parameter's
// distinct rows (or its dense matrix).
void CombineRows(OpKernelContext* ctx, const GroupConfig& cfg, const std::vector<ParamIds>& params,
                 const std::vector<Feature>& features, int f, int64_t begin, int64_t end,
                 float* out);

// CombineRows of the features marked in `combined`, in units of rows.
absl::Status CombineBlocks(OpKernelContext* ctx, const GroupConfig& cfg,
                           const std::vector<ParamIds>& params,
                           const std::vector<Feature>& features, const std::vector<bool>& combined,
                           const std::vector<float*>& outs);

// The factor that clips a row to L2 norm max_norm (1 when max_norm <= 0 or
// the row is within it); its norm in *norm_out when max_norm > 0.
inline float ClipScale(const float* row, int64_t dim, float max_norm, float* norm_out) {
  if (max_norm <= 0) return 1.0f;
  float sq = 0;
  for (int64_t d = 0; d < dim; ++d) sq += row[d] * row[d];
  const float norm = std::sqrt(sq);
  *norm_out = norm;
  return norm > max_norm ? max_norm / norm : 1.0f;
}

// 1 / the combiner's denominator of row b (0 when it is 0).
inline float CombinerScale(const Feature& ft, Combiner c, int64_t b) {
  if (c == kSum) return 1.0f;
  // Weights of 1 (none stored when built in place): UnweightedScale sums
  // them alike.
  if (!ft.weighted) return UnweightedScale(c, ft.splits[b + 1] - ft.splits[b]);
  float denom = 0;
  for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j) {
    const float w = ft.weights[j];
    denom += c == kMean ? w : w * w;
  }
  if (c == kSqrtn) denom = std::sqrt(denom);
  return denom == 0 ? 0.0f : 1.0f / denom;
}

}  // namespace kre

#endif  // KRE_KERNELS_DISTINCT_LOOKUP_H_
