// Copyright keras_rec_emb authors. Apache-2.0.
// The group lookup's configuration and input validation (see
// group_config.h).
#include "kernels/group_config.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {

absl::Status GroupConfig::Init(OpKernelConstruction* ctx) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &num_tables));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_dense", &num_dense));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_features", &num_features));
  int given_params;
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_params", &given_params));
  if (given_params != num_tables + num_dense) {
    return errors::InvalidArgument("num_params = ", given_params,
                                   " must be num_tables + num_dense = ", num_tables + num_dense);
  }
  TF_RETURN_IF_ERROR(ctx->GetAttr("table_key_dtypes", &key_dtypes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("param_dims", &dims));
  std::vector<int64_t> fp, default_ids;
  std::vector<std::string> comb;
  std::vector<float> max_norms;
  std::vector<bool> prune, sequence;
  TF_RETURN_IF_ERROR(ctx->GetAttr("feature_params", &fp));
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &comb));
  TF_RETURN_IF_ERROR(ctx->GetAttr("max_norms", &max_norms));
  TF_RETURN_IF_ERROR(ctx->GetAttr("default_ids", &default_ids));
  TF_RETURN_IF_ERROR(ctx->GetAttr("prune_invalid_ids", &prune));
  TF_RETURN_IF_ERROR(ctx->GetAttr("is_sequence", &sequence));
  TF_RETURN_IF_ERROR(ctx->GetAttr("concat", &concat));
  const size_t F = static_cast<size_t>(num_features);
  if (static_cast<int>(key_dtypes.size()) != num_tables) {
    return errors::InvalidArgument("table_key_dtypes has ", key_dtypes.size(), " entries for ",
                                   num_tables, " tables");
  }
  if (static_cast<int>(dims.size()) != num_params()) {
    return errors::InvalidArgument("param_dims has ", dims.size(), " entries for ", num_params(),
                                   " parameters");
  }
  for (int64_t d : dims) {
    if (d < 1) return errors::InvalidArgument("param_dims must be >= 1, got ", d);
  }
  if (fp.size() != F || comb.size() != F || max_norms.size() != F || default_ids.size() != F ||
      prune.size() != F || sequence.size() != F) {
    return errors::InvalidArgument(
        "feature_params, combiners, max_norms, default_ids, prune_invalid_ids "
        "and is_sequence must each have num_features = ",
        num_features, " entries");
  }
  features_of.assign(num_params(), {});
  feature.assign(F, FeatureAttrs());
  for (size_t f = 0; f < F; ++f) {
    FeatureAttrs& a = feature[f];
    if (fp[f] < 0 || fp[f] >= num_params()) {
      return errors::InvalidArgument("feature_params[", f, "] = ", fp[f],
                                     " is not a parameter index in [0, ", num_params(), ")");
    }
    a.param = static_cast<int>(fp[f]);
    features_of[a.param].push_back(static_cast<int>(f));
    if (!ParseCombiner(comb[f], &a.combiner)) {
      return errors::InvalidArgument("combiners[", f, "] must be sum, mean or sqrtn, got '",
                                     comb[f], "'");
    }
    a.max_norm = max_norms[f];
    a.default_id = default_ids[f];
    a.prune = prune[f];
    a.sequence = sequence[f];
    if (concat && a.sequence) {
      return errors::InvalidArgument("concat = true but feature ", f, " is a sequence feature");
    }
    a.column = width;
    width += dims[a.param];
  }
  return absl::OkStatus();
}

absl::Status BuildFeature(OpKernelContext* ctx, const GroupConfig& cfg, int f, Feature* out,
                          bool in_place) {
  const Tensor& ids_t = ctx->input(cfg.ids_input(f));
  const Tensor& splits_t = ctx->input(cfg.splits_input(f));
  const Tensor& weights_t = ctx->input(cfg.weights_input(f));
  if (ids_t.dims() != 1 || splits_t.dims() != 1 || weights_t.dims() != 1) {
    return errors::InvalidArgument("feature ", f, ": ids, row_splits and weights must be 1-D, got ",
                                   ids_t.shape().DebugString(), ", ",
                                   splits_t.shape().DebugString(), ", ",
                                   weights_t.shape().DebugString());
  }
  const int64_t nnz = ids_t.dim_size(0);
  const bool has_w = weights_t.dim_size(0) != 0 || nnz == 0;
  if (weights_t.dim_size(0) != 0 && weights_t.dim_size(0) != nnz) {
    return errors::InvalidArgument("feature ", f, ": weights must have as many entries as ids (",
                                   nnz, ") or none, got ", weights_t.dim_size(0));
  }
  // Checked in full before any row is read: a split past the ids would
  // read out of bounds.
  TF_RETURN_IF_ERROR(validate::Splits(
      splits_t, nnz, "row_splits[" + std::to_string(f) + "] (feature " + std::to_string(f) + ")"));
  const int64_t* ids = ids_t.flat<int64_t>().data();
  const int64_t* splits = splits_t.flat<int64_t>().data();
  const float* w = has_w && nnz > 0 ? weights_t.flat<float>().data() : nullptr;
  const int64_t batch = splits_t.dim_size(0) - 1;
  const int p = cfg.feature[f].param;
  const bool prune = cfg.feature[f].prune;
  // TF's safe_embedding_lookup_sparse (and DeepRec's fused lookup, whose
  // prune_sparse_weights is set for combiner != "sum"): with explicit
  // weights, a mean or sqrtn feature drops ids whose weight is <= 0.
  const bool prune_weights = weights_t.dim_size(0) != 0 && cfg.feature[f].combiner != kSum;
  const int64_t def = cfg.feature[f].default_id;
  const int64_t vocab = cfg.is_table(p) ? -1 : ctx->input(p).dim_size(0);
  out->batch = batch;
  out->weighted = w != nullptr;
  if (in_place && w == nullptr && !prune_weights && vocab < 0) {
    if (cfg.key_dtypes[p] == tf::DT_INT64 && nnz > 0) {  // (no ids: the pass below)
      // Read only: is any id < 0 (the OR of all ids is negative), any row
      // empty, and the longest row.
      int64_t any = 0, max_len = 0, min_len = nnz;
      for (int64_t j = 0; j < nnz; ++j) any |= ids[j];
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = splits[b + 1] - splits[b];
        max_len = std::max(max_len, len);
        min_len = std::min(min_len, len);
      }
      if (!(prune && any < 0) && !(def >= 0 && min_len == 0)) {
        out->given = ids;
        out->num_raw = nnz;
        out->splits.assign(splits, splits + batch + 1);
        out->max_len = max_len;
        return absl::OkStatus();
      }
    }
    // One branchless pass (a pruned id is written, then overwritten: one
    // slot of slack) into a buffer that is not zeroed first.
    out->raw.reset(new int64_t[nnz + (def >= 0 ? batch : 0) + 1]);
    int64_t* u = out->raw.get();
    out->splits.resize(batch + 1);
    int64_t n = 0, max_len = 0;
    out->splits[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t row_begin = n;
      for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
        const int64_t id = ids[j];
        u[n] = id;
        n += !(prune && id < 0);
      }
      if (n == row_begin && def >= 0) u[n++] = def;
      out->splits[b + 1] = n;
      max_len = std::max(max_len, n - row_begin);
    }
    out->max_len = max_len;
    out->num_raw = n;
    return absl::OkStatus();
  }
  if (w == nullptr && !prune_weights && vocab < 0 && def < 0) {
    // A table's unweighted ids with no default id: when none is pruned (no
    // id < 0, or no pruning), the kept ids are the ids as they are, copied
    // at once (the pass below writes them one by one after zeroing).
    int64_t any = 0;
    if (prune) {
      for (int64_t j = 0; j < nnz; ++j) any |= ids[j];
    }
    if (any >= 0) {
      out->ids.assign(ids, ids + nnz);
      out->weights.assign(nnz, 1.0f);
      out->splits.assign(splits, splits + batch + 1);
      int64_t max_len = 0;
      for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, splits[b + 1] - splits[b]);
      out->max_len = max_len;
      return absl::OkStatus();
    }
  }
  out->splits.resize(batch + 1);
  out->ids.resize(nnz + (def >= 0 ? batch : 0));
  out->weights.resize(out->ids.size());
  int64_t* oid = out->ids.data();
  float* ow = out->weights.data();
  int64_t n = 0;
  out->splits[0] = 0;
  out->max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t row_begin = n;
    for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
      const int64_t id = ids[j];
      if (prune && id < 0) continue;
      if (prune_weights && !(w[j] > 0.0f)) continue;
      if (vocab >= 0 && (id < 0 || id >= vocab)) {
        return errors::InvalidArgument("feature ", f, ": id ", id, " is out of range [0, ", vocab,
                                       ") of its dense embedding matrix");
      }
      oid[n] = id;
      ow[n] = w ? w[j] : 1.0f;
      ++n;
    }
    if (n == row_begin && def >= 0) {
      if (vocab >= 0 && def >= vocab) {
        return errors::InvalidArgument("feature ", f, ": default_id ", def, " is out of range [0, ",
                                       vocab, ")");
      }
      oid[n] = def;
      ow[n] = 1.0f;
      ++n;
    }
    out->splits[b + 1] = n;
    out->max_len = std::max(out->max_len, n - row_begin);
  }
  out->ids.resize(n);
  out->weights.resize(n);
  return absl::OkStatus();
}

int64_t BuildFeatureCost(OpKernelContext* ctx, const GroupConfig& cfg) {
  int64_t ids = 0;
  for (int f = 0; f < cfg.num_features; ++f) ids += ctx->input(cfg.ids_input(f)).NumElements();
  // About 20 cycles an id (its checks, the copy of it and its weight).
  return 20 * (ids / std::max(1, cfg.num_features) + 1);
}

absl::Status BuildFeatures(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<Feature>* features) {
  features->assign(cfg.num_features, Feature());
  std::vector<absl::Status> status(cfg.num_features);
  const int64_t cost = BuildFeatureCost(ctx, cfg);
  TF_RETURN_IF_ERROR(ParallelFor(ctx, cfg.num_features, cost, [&](int64_t f) {
    const int fi = static_cast<int>(f);
    status[f] = BuildFeature(ctx, cfg, fi, &(*features)[f], KeptIdsSuffice(cfg, fi));
  }));
  for (const auto& s : status) TF_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status ResolveTables(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<TableSlot>* tables) {
  tables->resize(cfg.num_tables);
  for (int t = 0; t < cfg.num_tables; ++t) {
    TF_RETURN_IF_ERROR(ResolveTable(ctx, t, t, cfg.key_dtypes[t], cfg.dims[t], &(*tables)[t]));
  }
  return absl::OkStatus();
}

absl::Status CheckDense(OpKernelContext* ctx, const GroupConfig& cfg) {
  for (int d = 0; d < cfg.num_dense; ++d) {
    const int p = cfg.num_tables + d;
    const Tensor& m = ctx->input(p);
    if (m.dims() != 2 || m.dim_size(1) != cfg.dims[p]) {
      return errors::InvalidArgument("dense parameter ", d, " must be [vocab, ", cfg.dims[p],
                                     "], got ", m.shape().DebugString());
    }
  }
  return absl::OkStatus();
}

}  // namespace kre
