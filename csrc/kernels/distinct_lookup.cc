// Copyright keras_rec_emb authors. Apache-2.0.
// The group lookup's deduplicating path (see distinct_lookup.h).
#include "kernels/distinct_lookup.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/distinct_ids.h"
#include "kernels/table_resource.h"
#include "kv/shard_ops.h"

namespace kre {
namespace {

// Deduplicates the ids of parameter p's features into *out (distinct ids in
// first-seen order), writing each feature's inverse; `hash` maps an id to
// its key's hash, `key` to the key as the table stores it.
template <typename HashFn, typename KeyFn>
void Dedupe(const GroupConfig& cfg, int p, std::vector<Feature>* features, HashFn&& hash,
            KeyFn&& key, ParamIds* out) {
  int64_t n = 0;
  for (int f : cfg.features_of[p]) n += (*features)[f].kept();
  DistinctBuilder<int64_t> distinct(n, &out->uniq, &out->hashes, &out->counts);
  for (int f : cfg.features_of[p]) {
    Feature& ft = (*features)[f];
    const int64_t* ids = ft.kept_ids();
    distinct.AddAll(ft.kept(), [&](int64_t j) { return key(ids[j]); }, hash, ft.inverse);
  }
}

// The row that entry j of feature f reads (parameter p).
inline const float* RowOf(OpKernelContext* ctx, const GroupConfig& cfg,
                          const std::vector<ParamIds>& params, const Feature& ft, int p,
                          int64_t j) {
  const int64_t dim = cfg.dims[p];
  if (!cfg.is_table(p)) return ctx->input(p).flat<float>().data() + ft.ids[j] * dim;
  return params[p].rows + static_cast<int64_t>(ft.inverse[j]) * dim;
}

// Units of the combine pass: kCombineRows rows of one feature, feature by
// feature (each parameter's rows stay in cache while its features read
// them; measured no faster row-block-major over all features).
constexpr int64_t kCombineRows = 256;

}  // namespace

void DedupeParam(const GroupConfig& cfg, const std::vector<TableSlot>& tables, int p,
                 std::vector<Feature>* features, ParamIds* ids) {
  if (!cfg.is_table(p)) {
    Dedupe(
        cfg, p, features, [](int64_t k) { return kv::HashKey(static_cast<uint64_t>(k)); },
        [](int64_t id) { return id; }, ids);
    return;
  }
  if (tables[p].t64) {
    Dedupe(
        cfg, p, features, [](int64_t k) { return kv::Table<int64_t>::Hash(k); },
        [](int64_t id) { return id; }, ids);
  } else {
    Dedupe(
        cfg, p, features,
        [](int64_t k) { return kv::Table<int32_t>::Hash(static_cast<int32_t>(k)); },
        [](int64_t id) { return static_cast<int64_t>(static_cast<int32_t>(id)); }, ids);
  }
  PartitionDistinct(tables[p], ids);
}

void PartitionDistinct(const TableSlot& table, ParamIds* ids) {
  const int64_t n = static_cast<int64_t>(ids->uniq.size());
  if (table.t64) {
    GroupByShard(table.t64->table(), ids->uniq.data(), ids->hashes.data(), n, &ids->by_shard64);
  } else {
    GroupByShard(table.t32->table(), ids->uniq.data(), ids->hashes.data(), n, &ids->by_shard32);
  }
}

absl::Status PrepareRows(OpKernelContext* ctx, const GroupConfig& cfg, int t, int64_t n,
                         ParamIds* ids) {
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(tf::DT_FLOAT, TensorShape({n, cfg.dims[t]}), &ids->rows_buffer));
  ids->rows = ids->rows_buffer.flat<float>().data();
  return absl::OkStatus();
}

void LookupShard(const std::vector<TableSlot>& tables, int t, int sh, bool insert, ParamIds* ids) {
  if (tables[t].t64) {
    LookupShardCounted(tables[t].t64->table(), ids->by_shard64, sh, ids->counts.data(), insert,
                       ids->rows);
  } else {
    LookupShardCounted(tables[t].t32->table(), ids->by_shard32, sh, ids->counts.data(), insert,
                       ids->rows);
  }
}

absl::Status LookupDistinct(OpKernelContext* ctx, const GroupConfig& cfg,
                            const std::vector<TableSlot>& tables, std::vector<ParamIds>* params,
                            bool insert, const std::vector<bool>& wanted) {
  std::vector<std::pair<int, int>> units;
  int64_t total = 0;
  for (int t = 0; t < cfg.num_tables; ++t) {
    if (!wanted[t]) continue;
    ParamIds& ids = (*params)[t];
    if (ids.rows == nullptr) {
      TF_RETURN_IF_ERROR(PrepareRows(ctx, cfg, t, static_cast<int64_t>(ids.uniq.size()), &ids));
    }
    total += static_cast<int64_t>(ids.uniq.size());
    for (int sh = 0; sh < tables[t].num_shards(); ++sh) units.emplace_back(t, sh);
  }
  if (units.empty()) return absl::OkStatus();
  const int64_t cost = 60 * (total / static_cast<int64_t>(units.size()) + 1);
  return ParallelFor(ctx, static_cast<int64_t>(units.size()), cost, [&](int64_t i) {
    const int t = units[i].first;
    LookupShard(tables, t, units[i].second, insert, &(*params)[t]);
  });
}

void CombineRows(OpKernelContext* ctx, const GroupConfig& cfg, const std::vector<ParamIds>& params,
                 const std::vector<Feature>& features, int f, int64_t begin, int64_t end,
                 float* out) {
  const Feature& ft = features[f];
  const int p = cfg.feature[f].param;
  const int64_t dim = cfg.dims[p];
  const float max_norm = cfg.feature[f].max_norm;
  const int64_t stride = cfg.row_stride(f);
  if (!ft.weighted && !cfg.feature[f].sequence && max_norm <= 0) {
    // Unweighted ids: the pooled path's combine (bit-identical to the loop
    // below for weights of 1), from the rows' pointers; its sums stay in
    // registers, and rows of up to kPaddedCombineLen ids are padded so
    // that no branch depends on a row's length.
    thread_local std::vector<const float*> rows;
    rows.resize(ft.splits[end] - ft.splits[begin] + 1);
    const Combiner comb = cfg.feature[f].combiner;
    if (cfg.is_table(p)) {
      CombineIndexedRows(dim, ft.splits.data(), begin, end, params[p].rows, ft.inverse, comb, out,
                         stride, rows.data());
    } else {
      CombineIndexedRows(dim, ft.splits.data(), begin, end, ctx->input(p).flat<float>().data(),
                         ft.ids.data(), comb, out, stride, rows.data());
    }
    return;
  }
  // Output rows that are whole aligned cache lines (a concatenated output's
  // columns of dim 16, 32, ...) are built in `acc` and streamed, as
  // CombinePooled's: a plain store would first read the line, cold in an
  // output of F features' columns (measured about a 5% faster training step
  // with 26 features of dim 16, 1 id per row, 1 thread).
  constexpr int64_t kMaxStreamedDim = 256;
  const bool stream =
      !cfg.feature[f].sequence && dim <= kMaxStreamedDim && kv::StreamableRows(out, dim, stride);
  alignas(64) float acc[kMaxStreamedDim];
  for (int64_t b = begin; b < end; ++b) {
    if (cfg.feature[f].sequence) {
      float* o = out + b * ft.max_len * dim;
      std::fill(o, o + ft.max_len * dim, 0.0f);
      for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j, o += dim) {
        const float* row = RowOf(ctx, cfg, params, ft, p, j);
        float norm;
        const float s = ft.weights[j] * ClipScale(row, dim, max_norm, &norm);
        for (int64_t d = 0; d < dim; ++d) o[d] = s * row[d];
      }
      continue;
    }
    float* dst = out + b * stride;
    float* o = stream ? acc : dst;
    const int64_t j0 = ft.splits[b], j1 = ft.splits[b + 1];
    if (j1 == j0 + 1 && max_norm <= 0) {
      // One id: sum gives w * row; mean and sqrtn give its row scaled by
      // w / w and w / |w| (the sign of w), written without the division.
      const float w = ft.weights[j0];
      const float* row = RowOf(ctx, cfg, params, ft, p, j0);
      const float s = cfg.feature[f].combiner == kSum    ? w
                      : w == 0                           ? 0.0f
                      : cfg.feature[f].combiner == kMean ? 1.0f
                                                         : (w > 0 ? 1.0f : -1.0f);
      for (int64_t d = 0; d < dim; ++d) o[d] = s * row[d];
      if (stream) kv::StreamRow(dst, acc, dim);
      continue;
    }
    std::fill(o, o + dim, 0.0f);
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = RowOf(ctx, cfg, params, ft, p, j);
      float norm;
      const float s = ft.weights[j] * ClipScale(row, dim, max_norm, &norm);
      for (int64_t d = 0; d < dim; ++d) o[d] += s * row[d];
    }
    const float c = CombinerScale(ft, cfg.feature[f].combiner, b);
    if (c != 1.0f) {
      for (int64_t d = 0; d < dim; ++d) o[d] *= c;
    }
    if (stream) kv::StreamRow(dst, acc, dim);
  }
  if (stream) kv::StreamFence();  // ordered before the op's output is read
}

absl::Status CombineBlocks(OpKernelContext* ctx, const GroupConfig& cfg,
                           const std::vector<ParamIds>& params,
                           const std::vector<Feature>& features, const std::vector<bool>& combined,
                           const std::vector<float*>& outs) {
  std::vector<std::pair<int, int64_t>> units;
  for (size_t f = 0; f < features.size(); ++f) {
    if (!combined[f]) continue;
    for (int64_t b = 0; b < features[f].batch; b += kCombineRows) {
      units.emplace_back(static_cast<int>(f), b);
    }
  }
  return ParallelFor(ctx, static_cast<int64_t>(units.size()), kCombineRows * 200, [&](int64_t u) {
    const int f = units[u].first;
    const int64_t begin = units[u].second;
    CombineRows(ctx, cfg, params, features, f, begin,
                std::min(features[f].batch, begin + kCombineRows), outs[f]);
  });
}

}  // namespace kre
