// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of the fused group lookup (csrc/ops/group_ops.cc): all features of
// a group, over all their embedding tables and dense matrices, in one
// forward op and one backward op, each a few passes over the intra-op pool.
//
// Forward:  (1) per feature, prune/default the ragged ids;  (2) per table,
// gather the keys of all its features and group them by shard;  (3) per
// (table, shard), look the keys up into one row buffer per table;  (4) per
// (feature, block of rows), clip and combine rows into the outputs.
// Backward: (1) as above;  (2) per (parameter, hash bucket), sum the row
// gradients of equal ids;  (3) copy the buckets into the outputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/table_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;
namespace errors = tf::errors;

enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

// Attributes shared by the forward and backward ops, validated once.
struct GroupConfig {
  int num_tables = 0;
  int num_dense = 0;
  int num_features = 0;
  std::vector<tf::DataType> key_dtypes;
  std::vector<int64_t> dims;
  std::vector<int> feature_param;
  std::vector<Combiner> combiners;
  std::vector<float> max_norms;
  std::vector<int64_t> default_ids;
  std::vector<bool> prune;
  std::vector<bool> sequence;
  // Features of each parameter, in feature order.
  std::vector<std::vector<int>> features_of;

  int num_params() const { return num_tables + num_dense; }
  bool is_table(int p) const { return p < num_tables; }

  absl::Status Init(OpKernelConstruction* ctx) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &num_tables));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_dense", &num_dense));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_features", &num_features));
    TF_RETURN_IF_ERROR(ctx->GetAttr("table_key_dtypes", &key_dtypes));
    TF_RETURN_IF_ERROR(ctx->GetAttr("param_dims", &dims));
    std::vector<int64_t> fp;
    TF_RETURN_IF_ERROR(ctx->GetAttr("feature_params", &fp));
    std::vector<std::string> comb;
    TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &comb));
    TF_RETURN_IF_ERROR(ctx->GetAttr("max_norms", &max_norms));
    TF_RETURN_IF_ERROR(ctx->GetAttr("default_ids", &default_ids));
    TF_RETURN_IF_ERROR(ctx->GetAttr("prune_invalid_ids", &prune));
    TF_RETURN_IF_ERROR(ctx->GetAttr("is_sequence", &sequence));
    const size_t F = static_cast<size_t>(num_features);
    if (static_cast<int>(key_dtypes.size()) != num_tables) {
      return errors::InvalidArgument("table_key_dtypes has ", key_dtypes.size(),
                                     " entries for ", num_tables, " tables");
    }
    if (static_cast<int>(dims.size()) != num_params()) {
      return errors::InvalidArgument("param_dims has ", dims.size(), " entries for ",
                                     num_params(), " parameters");
    }
    if (fp.size() != F || comb.size() != F || max_norms.size() != F ||
        default_ids.size() != F || prune.size() != F || sequence.size() != F) {
      return errors::InvalidArgument(
          "feature_params, combiners, max_norms, default_ids, prune_invalid_ids "
          "and is_sequence must each have num_features = ", num_features, " entries");
    }
    features_of.assign(num_params(), {});
    for (size_t f = 0; f < F; ++f) {
      if (fp[f] < 0 || fp[f] >= num_params()) {
        return errors::InvalidArgument("feature_params[", f, "] = ", fp[f],
                                       " is not a parameter index in [0, ",
                                       num_params(), ")");
      }
      feature_param.push_back(static_cast<int>(fp[f]));
      features_of[fp[f]].push_back(static_cast<int>(f));
      if (comb[f] == "sum") {
        combiners.push_back(kSum);
      } else if (comb[f] == "mean") {
        combiners.push_back(kMean);
      } else if (comb[f] == "sqrtn") {
        combiners.push_back(kSqrtn);
      } else {
        return errors::InvalidArgument("combiners[", f, "] must be sum, mean or sqrtn, got '",
                                       comb[f], "'");
      }
    }
    for (int64_t d : dims) {
      if (d < 1) return errors::InvalidArgument("param_dims must be >= 1, got ", d);
    }
    return absl::OkStatus();
  }

  int ids_input(int f) const { return num_params() + f; }
  int splits_input(int f) const { return num_params() + num_features + f; }
  int weights_input(int f) const { return num_params() + 2 * num_features + f; }
};

// One feature's ids after pruning and default-id filling.
struct Feature {
  int64_t batch = 0;
  int64_t max_len = 0;
  std::vector<int64_t> splits;  // [batch + 1]
  std::vector<int64_t> ids;
  std::vector<float> weights;
  int64_t offset = 0;  // position of ids[0] in its table's key buffer
};

absl::Status BuildFeature(OpKernelContext* ctx, const GroupConfig& cfg, int f,
                          Feature* out) {
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
  if (splits_t.dim_size(0) < 1) {
    return errors::InvalidArgument("feature ", f, ": row_splits must have at least 1 entry");
  }
  const int64_t* ids = ids_t.flat<int64_t>().data();
  const int64_t* splits = splits_t.flat<int64_t>().data();
  const float* w = has_w && nnz > 0 ? weights_t.flat<float>().data() : nullptr;
  const int64_t batch = splits_t.dim_size(0) - 1;
  if (splits[0] != 0 || splits[batch] != nnz) {
    return errors::InvalidArgument("feature ", f, ": row_splits must start at 0 and end at ",
                                   nnz, " (the number of ids), got [", splits[0], ", ...,",
                                   splits[batch], "]");
  }
  const int p = cfg.feature_param[f];
  const bool prune = cfg.prune[f];
  const int64_t def = cfg.default_ids[f];
  const int64_t vocab = cfg.is_table(p)
                            ? -1
                            : ctx->input(p).dim_size(0);
  out->batch = batch;
  out->splits.resize(batch + 1);
  out->ids.clear();
  out->weights.clear();
  out->ids.reserve(nnz + (def >= 0 ? batch : 0));
  out->weights.reserve(out->ids.capacity());
  out->splits[0] = 0;
  out->max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (splits[b + 1] < splits[b]) {
      return errors::InvalidArgument("feature ", f, ": row_splits must be non-decreasing");
    }
    for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
      const int64_t id = ids[j];
      if (prune && id < 0) continue;
      if (vocab >= 0 && (id < 0 || id >= vocab)) {
        return errors::InvalidArgument("feature ", f, ": id ", id,
                                       " is out of range [0, ", vocab,
                                       ") of its dense embedding matrix");
      }
      out->ids.push_back(id);
      out->weights.push_back(w ? w[j] : 1.0f);
    }
    if (static_cast<int64_t>(out->ids.size()) == out->splits[b] && def >= 0) {
      if (vocab >= 0 && def >= vocab) {
        return errors::InvalidArgument("feature ", f, ": default_id ", def,
                                       " is out of range [0, ", vocab, ")");
      }
      out->ids.push_back(def);
      out->weights.push_back(1.0f);
    }
    out->splits[b + 1] = static_cast<int64_t>(out->ids.size());
    out->max_len = std::max(out->max_len, out->splits[b + 1] - out->splits[b]);
  }
  return absl::OkStatus();
}

absl::Status BuildFeatures(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<Feature>* features) {
  features->assign(cfg.num_features, Feature());
  std::vector<absl::Status> status(cfg.num_features);
  TF_RETURN_IF_ERROR(ParallelFor(ctx, cfg.num_features, 1000, [&](int64_t f) {
    status[f] = BuildFeature(ctx, cfg, static_cast<int>(f), &(*features)[f]);
  }));
  for (const auto& s : status) TF_RETURN_IF_ERROR(s);
  // Offsets of each feature's ids in its parameter's key buffer.
  for (int p = 0; p < cfg.num_params(); ++p) {
    int64_t off = 0;
    for (int f : cfg.features_of[p]) {
      (*features)[f].offset = off;
      off += static_cast<int64_t>((*features)[f].ids.size());
    }
  }
  return absl::OkStatus();
}

// A table of either key dtype, with the rows its features read.
struct TableSlot {
  tf::core::RefCountPtr<TableResource<int64_t>> t64;
  tf::core::RefCountPtr<TableResource<int32_t>> t32;
  int64_t dim() const { return t64 ? t64->table().dim() : t32->table().dim(); }
  int num_shards() const {
    return t64 ? t64->table().num_shards() : t32->table().num_shards();
  }
  std::vector<int64_t> keys64;
  std::vector<int32_t> keys32;
  kv::Partitioned<int64_t> part64;
  kv::Partitioned<int32_t> part32;
  std::vector<float> rows;  // [n, dim]
};

absl::Status ResolveTables(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<TableSlot>* tables) {
  tables->resize(cfg.num_tables);
  for (int t = 0; t < cfg.num_tables; ++t) {
    tf::core::RefCountPtr<TableResourceBase> base;
    TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, t), &base));
    if (base->key_dtype() != cfg.key_dtypes[t]) {
      return errors::InvalidArgument("table ", t, " has key dtype ",
                                     tf::DataTypeString(base->key_dtype()),
                                     " but the op was told ",
                                     tf::DataTypeString(cfg.key_dtypes[t]));
    }
    if (base->dim() != cfg.dims[t]) {
      return errors::InvalidArgument("table ", t, " has dim ", base->dim(),
                                     " but the op expects dim ", cfg.dims[t]);
    }
    TableSlot& s = (*tables)[t];
    if (cfg.key_dtypes[t] == tf::DT_INT64) {
      auto* typed = dynamic_cast<TableResource<int64_t>*>(base.get());
      if (typed == nullptr) return errors::Internal("table ", t, " is not int64-keyed");
      typed->Ref();
      s.t64.reset(typed);
    } else {
      auto* typed = dynamic_cast<TableResource<int32_t>*>(base.get());
      if (typed == nullptr) return errors::Internal("table ", t, " is not int32-keyed");
      typed->Ref();
      s.t32.reset(typed);
    }
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

template <typename K>
void GatherAndPartition(const GroupConfig& cfg, int t, const std::vector<Feature>& features,
                        const kv::Table<K>& table, std::vector<K>* keys,
                        kv::Partitioned<K>* part) {
  int64_t n = 0;
  for (int f : cfg.features_of[t]) n += static_cast<int64_t>(features[f].ids.size());
  keys->resize(n);
  for (int f : cfg.features_of[t]) {
    const Feature& ft = features[f];
    for (size_t j = 0; j < ft.ids.size(); ++j) {
      (*keys)[ft.offset + j] = static_cast<K>(ft.ids[j]);
    }
  }
  *part = kv::Partition(table, keys->data(), n, 1, [](int num_blocks, auto&& fn) {
    for (int b = 0; b < num_blocks; ++b) fn(b);
  });
}

// Reads the rows of every table key of every feature into tables[t].rows.
absl::Status LookupTables(OpKernelContext* ctx, const GroupConfig& cfg,
                          const std::vector<Feature>& features,
                          std::vector<TableSlot>* tables, bool insert,
                          const std::vector<bool>& wanted) {
  std::vector<int> todo;
  for (int t = 0; t < cfg.num_tables; ++t) {
    if (wanted[t]) todo.push_back(t);
  }
  if (todo.empty()) return absl::OkStatus();
  TF_RETURN_IF_ERROR(ParallelFor(ctx, static_cast<int64_t>(todo.size()), 20000, [&](int64_t i) {
    TableSlot& s = (*tables)[todo[i]];
    if (s.t64) {
      GatherAndPartition(cfg, todo[i], features, s.t64->table(), &s.keys64, &s.part64);
      s.rows.resize(s.keys64.size() * s.dim());
    } else {
      GatherAndPartition(cfg, todo[i], features, s.t32->table(), &s.keys32, &s.part32);
      s.rows.resize(s.keys32.size() * s.dim());
    }
  }));
  // One unit per (table, shard).
  std::vector<std::pair<int, int>> units;
  for (int t : todo) {
    for (int sh = 0; sh < (*tables)[t].num_shards(); ++sh) units.emplace_back(t, sh);
  }
  int64_t total = 0;
  for (int t : todo) total += static_cast<int64_t>((*tables)[t].rows.size());
  const int64_t cost = 40 * (total / std::max<int64_t>(1, units.size()) + 1);
  return ParallelFor(ctx, static_cast<int64_t>(units.size()), cost, [&](int64_t u) {
    TableSlot& s = (*tables)[units[u].first];
    const int sh = units[u].second;
    if (s.t64) {
      const auto& p = s.part64;
      const int64_t b = p.offsets[sh];
      s.t64->table().Lookup(sh, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                            p.offsets[sh + 1] - b, insert, s.rows.data());
    } else {
      const auto& p = s.part32;
      const int64_t b = p.offsets[sh];
      s.t32->table().Lookup(sh, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                            p.offsets[sh + 1] - b, insert, s.rows.data());
    }
  });
}

// The row of entry j of feature f.
inline const float* RowOf(OpKernelContext* ctx, const GroupConfig& cfg,
                          const std::vector<TableSlot>& tables, const Feature& ft, int p,
                          int64_t j) {
  const int64_t dim = cfg.dims[p];
  if (cfg.is_table(p)) return tables[p].rows.data() + (ft.offset + j) * dim;
  return ctx->input(p).flat<float>().data() + ft.ids[j] * dim;
}

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
  float denom = 0;
  for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j) {
    const float w = ft.weights[j];
    denom += c == kMean ? w : w * w;
  }
  if (c == kSqrtn) denom = std::sqrt(denom);
  return denom == 0 ? 0.0f : 1.0f / denom;
}

constexpr int64_t kRowsPerUnit = 256;

std::vector<std::pair<int, int64_t>> RowBlocks(const std::vector<Feature>& features) {
  std::vector<std::pair<int, int64_t>> units;
  for (size_t f = 0; f < features.size(); ++f) {
    for (int64_t b = 0; b < features[f].batch; b += kRowsPerUnit) {
      units.emplace_back(static_cast<int>(f), b);
    }
  }
  return units;
}

class GroupLookupOp : public OpKernel {
 public:
  explicit GroupLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("insert", &insert_));
  }

  void Compute(OpKernelContext* ctx) override {
    const GroupConfig& cfg = cfg_;
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    std::vector<Feature> features;
    OP_REQUIRES_OK(ctx, BuildFeatures(ctx, cfg, &features));
    OP_REQUIRES_OK(ctx, LookupTables(ctx, cfg, features, &tables, insert_,
                                     std::vector<bool>(cfg.num_tables, true)));
    std::vector<float*> outs(cfg.num_features);
    for (int f = 0; f < cfg.num_features; ++f) {
      const int64_t dim = cfg.dims[cfg.feature_param[f]];
      TensorShape shape = cfg.sequence[f]
                              ? TensorShape({features[f].batch, features[f].max_len, dim})
                              : TensorShape({features[f].batch, dim});
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(f, shape, &out));
      outs[f] = out->flat<float>().data();
    }
    const auto units = RowBlocks(features);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, static_cast<int64_t>(units.size()),
                                    kRowsPerUnit * 200, [&](int64_t u) {
      const int f = units[u].first;
      const Feature& ft = features[f];
      const int p = cfg.feature_param[f];
      const int64_t dim = cfg.dims[p];
      const float max_norm = cfg.max_norms[f];
      const int64_t end = std::min(ft.batch, units[u].second + kRowsPerUnit);
      for (int64_t b = units[u].second; b < end; ++b) {
        if (cfg.sequence[f]) {
          float* o = outs[f] + b * ft.max_len * dim;
          std::fill(o, o + ft.max_len * dim, 0.0f);
          for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j, o += dim) {
            const float* row = RowOf(ctx, cfg, tables, ft, p, j);
            float norm;
            const float s = ft.weights[j] * ClipScale(row, dim, max_norm, &norm);
            for (int64_t d = 0; d < dim; ++d) o[d] = s * row[d];
          }
          continue;
        }
        float* o = outs[f] + b * dim;
        std::fill(o, o + dim, 0.0f);
        for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j) {
          const float* row = RowOf(ctx, cfg, tables, ft, p, j);
          float norm;
          const float s = ft.weights[j] * ClipScale(row, dim, max_norm, &norm);
          for (int64_t d = 0; d < dim; ++d) o[d] += s * row[d];
        }
        const float c = CombinerScale(ft, cfg.combiners[f], b);
        if (c != 1.0f) {
          for (int64_t d = 0; d < dim; ++d) o[d] *= c;
        }
      }
    }));
  }

 private:
  GroupConfig cfg_;
  bool insert_;
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookup").Device(tf::DEVICE_CPU), GroupLookupOp);

// Distinct ids of one (parameter, hash bucket) with their summed gradients.
struct Bucket {
  std::vector<int64_t> ids;
  std::vector<float> grads;
  int64_t out_offset = 0;
};

class GroupLookupGradOp : public OpKernel {
 public:
  explicit GroupLookupGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    const GroupConfig& cfg = cfg_;
    const int P = cfg.num_params();
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    std::vector<Feature> features;
    OP_REQUIRES_OK(ctx, BuildFeatures(ctx, cfg, &features));
    const int grads0 = P + 3 * cfg.num_features;
    std::vector<const float*> grads(cfg.num_features);
    for (int f = 0; f < cfg.num_features; ++f) {
      const Tensor& g = ctx->input(grads0 + f);
      const int64_t dim = cfg.dims[cfg.feature_param[f]];
      const Feature& ft = features[f];
      const TensorShape want = cfg.sequence[f] ? TensorShape({ft.batch, ft.max_len, dim})
                                               : TensorShape({ft.batch, dim});
      OP_REQUIRES(ctx, g.shape() == want,
                  errors::InvalidArgument("output_grads[", f, "] must be ",
                                          want.DebugString(), ", got ",
                                          g.shape().DebugString()));
      grads[f] = g.flat<float>().data();
    }
    // Rows are needed only to differentiate the max_norm clip.
    std::vector<bool> wanted(cfg.num_tables, false);
    for (int f = 0; f < cfg.num_features; ++f) {
      const int p = cfg.feature_param[f];
      if (cfg.is_table(p) && cfg.max_norms[f] > 0) wanted[p] = true;
    }
    OP_REQUIRES_OK(ctx, LookupTables(ctx, cfg, features, &tables, false, wanted));

    // Units: (parameter, bucket) with the ids of bucket b having hash % n == b.
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    std::vector<int> num_buckets(P), first_unit(P + 1, 0);
    for (int p = 0; p < P; ++p) {
      int64_t n = 0;
      for (int f : cfg.features_of[p]) n += static_cast<int64_t>(features[f].ids.size());
      num_buckets[p] = static_cast<int>(
          std::max<int64_t>(1, std::min<int64_t>(4 * threads, n / 8192)));
      first_unit[p + 1] = first_unit[p] + num_buckets[p];
    }
    std::vector<Bucket> buckets(first_unit[P]);
    std::vector<int> unit_param(first_unit[P]);
    for (int p = 0; p < P; ++p) {
      for (int u = first_unit[p]; u < first_unit[p + 1]; ++u) unit_param[u] = p;
    }
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, first_unit[P], 100000, [&](int64_t u) {
      const int p = unit_param[u];
      const int nb = num_buckets[p];
      const int bucket = static_cast<int>(u - first_unit[p]);
      Accumulate(ctx, cfg, tables, features, grads, p, nb, bucket, &buckets[u]);
    }));
    for (int p = 0; p < P; ++p) {
      int64_t n = 0;
      for (int u = first_unit[p]; u < first_unit[p + 1]; ++u) {
        buckets[u].out_offset = n;
        n += static_cast<int64_t>(buckets[u].ids.size());
      }
      Tensor *ids_out, *grads_out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(p, TensorShape({n}), &ids_out));
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_output(P + p, TensorShape({n, cfg.dims[p]}), &grads_out));
      int64_t* io = ids_out->flat<int64_t>().data();
      float* go = grads_out->flat<float>().data();
      for (int u = first_unit[p]; u < first_unit[p + 1]; ++u) {
        const Bucket& bk = buckets[u];
        if (bk.ids.empty()) continue;
        std::memcpy(io + bk.out_offset, bk.ids.data(), bk.ids.size() * sizeof(int64_t));
        std::memcpy(go + bk.out_offset * cfg.dims[p], bk.grads.data(),
                    bk.grads.size() * sizeof(float));
      }
    }
  }

 private:
  static void Accumulate(OpKernelContext* ctx, const GroupConfig& cfg,
                         const std::vector<TableSlot>& tables,
                         const std::vector<Feature>& features,
                         const std::vector<const float*>& grads, int p, int nb, int bucket,
                         Bucket* out) {
    const int64_t dim = cfg.dims[p];
    int64_t n = 0;
    for (int f : cfg.features_of[p]) n += static_cast<int64_t>(features[f].ids.size());
    uint64_t cap = 16;
    while (cap < 2 * static_cast<uint64_t>(n / nb + 1)) cap <<= 1;
    std::vector<int64_t> slot(cap, -1);  // position in out->ids
    std::vector<float> g(dim);
    for (int f : cfg.features_of[p]) {
      const Feature& ft = features[f];
      const float max_norm = cfg.max_norms[f];
      for (int64_t b = 0; b < ft.batch; ++b) {
        const int64_t begin = ft.splits[b], end = ft.splits[b + 1];
        if (begin == end) continue;
        const float c = cfg.sequence[f] ? 1.0f : CombinerScale(ft, cfg.combiners[f], b);
        for (int64_t j = begin; j < end; ++j) {
          const int64_t id = ft.ids[j];
          const uint64_t h = kv::HashKey(static_cast<uint64_t>(id));
          if (nb > 1 && static_cast<int>(h % nb) != bucket) continue;
          const float* dout = cfg.sequence[f] ? grads[f] + (b * ft.max_len + (j - begin)) * dim
                                              : grads[f] + b * dim;
          const float s = c * ft.weights[j];
          for (int64_t d = 0; d < dim; ++d) g[d] = s * dout[d];
          if (max_norm > 0) {
            // d/dx of x * m / max(|x|, m): (m/|x|)(g - x (x.g) / |x|^2).
            const float* x = RowOf(ctx, cfg, tables, ft, p, j);
            float norm = 0;
            if (ClipScale(x, dim, max_norm, &norm) < 1.0f) {
              float xg = 0;
              for (int64_t d = 0; d < dim; ++d) xg += x[d] * g[d];
              const float k = xg / (norm * norm);
              const float r = max_norm / norm;
              for (int64_t d = 0; d < dim; ++d) g[d] = r * (g[d] - x[d] * k);
            }
          }
          if (2 * (out->ids.size() + 1) > cap) {  // grow: keep load <= 1/2
            cap <<= 1;
            slot.assign(cap, -1);
            for (size_t r = 0; r < out->ids.size(); ++r) {
              uint64_t k = (kv::HashKey(static_cast<uint64_t>(out->ids[r])) >> 7) & (cap - 1);
              while (slot[k] >= 0) k = (k + 1) & (cap - 1);
              slot[k] = static_cast<int64_t>(r);
            }
          }
          uint64_t i = (h >> 7) & (cap - 1);
          while (slot[i] >= 0 && out->ids[slot[i]] != id) i = (i + 1) & (cap - 1);
          if (slot[i] < 0) {
            slot[i] = static_cast<int64_t>(out->ids.size());
            out->ids.push_back(id);
            out->grads.insert(out->grads.end(), g.begin(), g.end());
          } else {
            float* acc = out->grads.data() + slot[i] * dim;
            for (int64_t d = 0; d < dim; ++d) acc[d] += g[d];
          }
        }
      }
    }
  }

  GroupConfig cfg_;
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookupGrad").Device(tf::DEVICE_CPU), GroupLookupGradOp);

}  // namespace
}  // namespace kre
