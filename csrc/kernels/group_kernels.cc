// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of the fused group lookup (csrc/ops/group_ops.cc): all features of
// a group, over all their embedding tables and dense matrices, in one
// forward op and one backward op, each a few passes over the intra-op pool.
//
// Forward:  (1) per feature, prune/default the ragged ids;  (2) per
// parameter, deduplicate the ids of all its features (distinct ids, their
// counts, each id's index among them: `inverse`) and, for a table, group
// the distinct keys by shard;  (3) per (table, shard), look up each
// distinct key once, counted as often as it occurs;  (4) per (feature,
// block of rows), clip and combine rows into the outputs. The distinct ids
// and `inverse` are outputs too, for the backward.
// Lean single-id path (attr `lean_single_id`, on by default, inference
// lookups only; see LeanFeature): a table's only feature, given one id per
// row without weights or max_norm, is looked up straight from its ids
// input into the output, skipping (1), (2) and (4); measured about half the
// CPU of the general path (26 features, batch 4096, Zipf ids).
// Lean pooled path (attr `lean_pooled`, on by default, inference lookups
// only; see LeanPooledParam): a table's only feature with 0..L ids per row
// and no weights, max_norm or sequence output skips (2): its kept ids are
// looked up in batch order and combined as (4) does: with
// kv::Table::OrderedReader in blocks of ~1k ids, each block's rows found
// (pointers, prefetched) and then combined straight from the table
// (LeanPooledRows), or (filtered or large tables, small batches) by a
// partition by shard into a row buffer and CombineRows.
// Single-id fast path (attr `single_id`, off by default, inference lookups
// only; with repeated ids the dedupe measured as fast or faster): a table
// whose features all have exactly one id per row skips (2)'s
// deduplication; every id is looked up where it occurs, as a separate
// table lookup does, straight into the output when the rows are plain
// copies (`unique_ids` then lists every id and `inverse` is 0, 1, 2, ...).
// Backward: (1) as above;  (2) per (parameter, range of distinct ids), sum
// the row gradients through `inverse` (no hashing, no table access unless a
// max_norm clip must be differentiated).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <immintrin.h>

#include "kernels/pooled_combine.h"
#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "kv/shard_ops.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

// How one feature is read and combined (the op's per-feature attributes).
// All set by GroupConfig::Init.
struct FeatureAttrs {
  int param;  // index of its parameter: tables first, then dense params
  Combiner combiner;
  float max_norm;      // <= 0: no clipping
  int64_t default_id;  // < 0: empty rows give zeros
  bool prune, sequence;
  int64_t column;  // with `concat`, its first column in the [batch, width] output
};

// Attributes shared by the forward and backward ops, validated once.
struct GroupConfig {
  int num_tables = 0;
  int num_dense = 0;
  int num_features = 0;
  std::vector<tf::DataType> key_dtypes;
  std::vector<int64_t> dims;
  std::vector<FeatureAttrs> feature;
  // Features of each parameter, in feature order.
  std::vector<std::vector<int>> features_of;
  // `concat`: the features' outputs side by side in one [batch, width]
  // tensor, feature f's columns from feature[f].column.
  bool concat = false;
  int64_t width = 0;
  // Forward only: tables whose features have one id per row skip the
  // deduplication (see the top of this file).
  bool single_id = false;
  // Forward only: the lean single-id path alone (see LeanFeature).
  bool lean_single_id = false;
  // Forward only: the lean pooled path (see LeanPooledParam).
  bool lean_pooled = false;

  int num_params() const { return num_tables + num_dense; }
  bool is_table(int p) const { return p < num_tables; }

  absl::Status Init(OpKernelConstruction* ctx) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &num_tables));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_dense", &num_dense));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_features", &num_features));
    int given_params;
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_params", &given_params));
    if (given_params != num_tables + num_dense) {
      return errors::InvalidArgument("num_params = ", given_params,
                                     " must be num_tables + num_dense = ",
                                     num_tables + num_dense);
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
      return errors::InvalidArgument("table_key_dtypes has ", key_dtypes.size(),
                                     " entries for ", num_tables, " tables");
    }
    if (static_cast<int>(dims.size()) != num_params()) {
      return errors::InvalidArgument("param_dims has ", dims.size(), " entries for ",
                                     num_params(), " parameters");
    }
    for (int64_t d : dims) {
      if (d < 1) return errors::InvalidArgument("param_dims must be >= 1, got ", d);
    }
    if (fp.size() != F || comb.size() != F || max_norms.size() != F ||
        default_ids.size() != F || prune.size() != F || sequence.size() != F) {
      return errors::InvalidArgument(
          "feature_params, combiners, max_norms, default_ids, prune_invalid_ids "
          "and is_sequence must each have num_features = ", num_features, " entries");
    }
    features_of.assign(num_params(), {});
    feature.assign(F, FeatureAttrs());
    for (size_t f = 0; f < F; ++f) {
      FeatureAttrs& a = feature[f];
      if (fp[f] < 0 || fp[f] >= num_params()) {
        return errors::InvalidArgument("feature_params[", f, "] = ", fp[f],
                                       " is not a parameter index in [0, ",
                                       num_params(), ")");
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

  // Where row b of feature f's output (or its gradient) starts, relative to
  // that feature's base pointer: rows are `width` apart when concatenated.
  int64_t row_stride(int f) const { return concat ? width : dims[feature[f].param]; }

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
  // Forward: ids[j] is distinct id inverse[j] of its parameter, and its
  // rank[j]-th occurrence in the batch (ranks only for filtered tables).
  int32_t* inverse = nullptr;
  std::vector<int32_t> rank;
  // A lean pooled feature built in place (see BuildFeature's `in_place`):
  // its num_raw kept ids in `raw` (not zeroed first), or, when its ids
  // input needed no pruning or filling, that input itself (`given`); no
  // weights; `ids` and `weights` stay empty.
  std::shared_ptr<int64_t[]> raw;  // (Features are copied by assign)
  const int64_t* given = nullptr;
  int64_t num_raw = 0;
  bool in_place() const { return raw || given; }
  int64_t kept() const { return in_place() ? num_raw : static_cast<int64_t>(ids.size()); }
};

// With `in_place` (a lean pooled feature of a table read with
// LookupOrdered: no weights), the kept ids go to Feature::raw, no weights
// are written; when the ids need no pruning and no row filling (as
// KRE>UnstackKeptIds gives them) and the table's keys are int64, they are
// read from the input where they are (Feature::given).
absl::Status BuildFeature(OpKernelContext* ctx, const GroupConfig& cfg, int f,
                          Feature* out, bool in_place = false) {
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
  TF_RETURN_IF_ERROR(validate::Splits(splits_t, nnz,
                                      "row_splits[" + std::to_string(f) + "] (feature " +
                                          std::to_string(f) + ")"));
  const int64_t* ids = ids_t.flat<int64_t>().data();
  const int64_t* splits = splits_t.flat<int64_t>().data();
  const float* w = has_w && nnz > 0 ? weights_t.flat<float>().data() : nullptr;
  const int64_t batch = splits_t.dim_size(0) - 1;
  const int p = cfg.feature[f].param;
  const bool prune = cfg.feature[f].prune;
  // TF's safe_embedding_lookup_sparse (and DeepRec's fused lookup, whose
  // prune_sparse_weights is set for combiner != "sum"): with explicit
  // weights, a mean or sqrtn feature drops ids whose weight is <= 0.
  const bool prune_weights =
      weights_t.dim_size(0) != 0 && cfg.feature[f].combiner != kSum;
  const int64_t def = cfg.feature[f].default_id;
  const int64_t vocab = cfg.is_table(p)
                            ? -1
                            : ctx->input(p).dim_size(0);
  out->batch = batch;
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
        return errors::InvalidArgument("feature ", f, ": id ", id,
                                       " is out of range [0, ", vocab,
                                       ") of its dense embedding matrix");
      }
      oid[n] = id;
      ow[n] = w ? w[j] : 1.0f;
      ++n;
    }
    if (n == row_begin && def >= 0) {
      if (vocab >= 0 && def >= vocab) {
        return errors::InvalidArgument("feature ", f, ": default_id ", def,
                                       " is out of range [0, ", vocab, ")");
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

absl::Status BuildFeatures(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<Feature>* features) {
  features->assign(cfg.num_features, Feature());
  std::vector<absl::Status> status(cfg.num_features);
  TF_RETURN_IF_ERROR(ParallelFor(ctx, cfg.num_features, 1000, [&](int64_t f) {
    status[f] = BuildFeature(ctx, cfg, static_cast<int>(f), &(*features)[f]);
  }));
  for (const auto& s : status) TF_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// The distinct ids one parameter is read with, and for a table their rows.
struct ParamIds {
  std::vector<int64_t> uniq;     // distinct ids (table keys in the key dtype)
  std::vector<uint64_t> hashes;  // their hashes
  std::vector<int32_t> counts;   // occurrences in the batch
  // Tables: the distinct keys grouped by shard (positions into uniq), their
  // rows [U, dim] and how many leading occurrences read no_permission_value.
  std::vector<int64_t> keys64;
  std::vector<int32_t> keys32;
  std::vector<uint64_t> part_hashes;
  std::vector<int64_t> order;
  std::vector<int64_t> offsets;
  // From TensorFlow's allocator (a pool: a per-step buffer of this size
  // from malloc took fresh pages, zeroed by the kernel, every step).
  Tensor rows_buffer;
  float* rows = nullptr;
  std::vector<int32_t> skips;
  // False on the single-id fast path: uniq holds every id, repeats too.
  bool distinct = true;
  // Set when the fast path writes its rows straight into the feature's
  // output (order[] then holds output positions in units of dim).
  float* direct_out = nullptr;
  // The lean path with kv::Table::LookupOrdered (no partition by shard):
  // the feature's keys in batch order (the ids input itself for an int64
  // table, keys32 for an int32 one), whose rows go to direct_out + j *
  // ordered_stride.
  bool ordered = false;
  const int64_t* ordered_keys64 = nullptr;
  int64_t num_ordered = 0;
  int64_t ordered_stride = 0;
  // The lean pooled path of a feature read in place: uniq stays empty; its
  // unique_ids output, allocated before the lookups, is `raw_out`.
  int64_t* raw_out = nullptr;
  // The unique_ids output is set already: `raw_out` allocated (which is
  // null when no id is kept, so it cannot say so itself) or a lean pooled
  // feature's ids input forwarded (Feature::given).
  bool unique_set = false;
};

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

// Deduplicates the ids of parameter p's features into *out, writing each
// feature's inverse (and ranks, when wanted); `hash` maps an id to its key's
// hash, `key` to the key as the table stores it.
template <typename HashFn, typename KeyFn>
void Dedupe(const GroupConfig& cfg, int p, std::vector<Feature>* features, bool ranks,
            HashFn&& hash, KeyFn&& key, ParamIds* out) {
  int64_t n = 0;
  for (int f : cfg.features_of[p]) n += static_cast<int64_t>((*features)[f].ids.size());
  uint64_t cap = 16;
  while (cap < 2 * static_cast<uint64_t>(n)) cap <<= 1;
  const uint64_t mask = cap - 1;
  std::vector<int32_t> slot(cap, -1);
  out->uniq.clear();
  out->hashes.clear();
  out->counts.clear();
  out->uniq.reserve(n);
  out->hashes.reserve(n);
  out->counts.reserve(n);
  for (int f : cfg.features_of[p]) {
    Feature& ft = (*features)[f];
    const int64_t m = static_cast<int64_t>(ft.ids.size());
    if (ranks) ft.rank.resize(m);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t k = key(ft.ids[j]);
      const uint64_t h = hash(k);
      uint64_t i = (h ^ (h >> 29)) & mask;
      int32_t u;
      while (true) {
        u = slot[i];
        if (u < 0) {
          u = static_cast<int32_t>(out->uniq.size());
          slot[i] = u;
          out->uniq.push_back(k);
          out->hashes.push_back(h);
          out->counts.push_back(0);
          break;
        }
        if (out->uniq[u] == k) break;
        i = (i + 1) & mask;
      }
      ft.inverse[j] = u;
      if (ranks) ft.rank[j] = out->counts[u];
      ++out->counts[u];
    }
  }
}

// Groups the n keys whose hashes are ids->hashes[0..n) by shard (a counting
// sort): ids->offsets bound each shard's range, and the key u that lands at
// position i gets (*keys)[i] = key_of(u), part_hashes[i] = its hash and
// order[i] = order_of(u).
template <typename K, typename KeyOf, typename OrderOf>
void SortByShard(const kv::Table<K>& table, int64_t n, KeyOf&& key_of, OrderOf&& order_of,
                 ParamIds* ids, std::vector<K>* keys) {
  const int shards = table.num_shards();
  ids->offsets.assign(shards + 1, 0);
  for (int64_t u = 0; u < n; ++u) ++ids->offsets[table.ShardOf(ids->hashes[u]) + 1];
  for (int s = 0; s < shards; ++s) ids->offsets[s + 1] += ids->offsets[s];
  std::vector<int64_t> next(ids->offsets.begin(), ids->offsets.end() - 1);
  keys->resize(n);
  ids->part_hashes.resize(n);
  ids->order.resize(n);
  for (int64_t u = 0; u < n; ++u) {
    const uint64_t h = ids->hashes[u];
    const int64_t j = next[table.ShardOf(h)]++;
    (*keys)[j] = key_of(u);
    ids->part_hashes[j] = h;
    ids->order[j] = order_of(u);
  }
}

// Groups a table's distinct keys by shard.
template <typename K>
void PartitionDistinct(const kv::Table<K>& table, ParamIds* ids, std::vector<K>* keys) {
  SortByShard(
      table, static_cast<int64_t>(ids->uniq.size()),
      [&](int64_t u) { return static_cast<K>(ids->uniq[u]); }, [](int64_t u) { return u; },
      ids, keys);
}

// Whether table p takes the single-id fast path: every feature of it has
// exactly one id per row (after pruning and default filling) and is not a
// sequence feature.
bool SingleIdParam(const GroupConfig& cfg, const std::vector<Feature>& features, int p) {
  if (!cfg.single_id || !cfg.is_table(p)) return false;
  for (int f : cfg.features_of[p]) {
    const Feature& ft = features[f];
    if (cfg.feature[f].sequence || static_cast<int64_t>(ft.ids.size()) != ft.batch ||
        ft.max_len > 1) {
      return false;
    }
  }
  return true;
}

// The fast path's "dedupe": every id of table p's features, in feature and
// row order, each its own entry (inverse 0, 1, 2, ...).
template <typename HashFn, typename KeyFn>
void EveryId(const GroupConfig& cfg, int p, std::vector<Feature>* features, HashFn&& hash,
             KeyFn&& key, ParamIds* out) {
  out->distinct = false;
  out->uniq.clear();
  out->hashes.clear();
  for (int f : cfg.features_of[p]) {
    Feature& ft = (*features)[f];
    const int32_t base = static_cast<int32_t>(out->uniq.size());
    for (size_t j = 0; j < ft.ids.size(); ++j) {
      const int64_t k = key(ft.ids[j]);
      out->uniq.push_back(k);
      out->hashes.push_back(hash(k));
      ft.inverse[j] = base + static_cast<int32_t>(j);
    }
  }
  out->counts.assign(out->uniq.size(), 1);
}

// Deduplicates parameter p's ids (or, on the single-id fast path, takes
// every id) and, for a table, groups its keys by shard.
void DedupeParam(const GroupConfig& cfg, const std::vector<TableSlot>& tables, int p,
                 std::vector<Feature>* features, ParamIds* ids) {
  if (SingleIdParam(cfg, *features, p)) {
    const TableSlot& t = tables[p];
    if (t.t64) {
      EveryId(cfg, p, features, [](int64_t k) { return kv::Table<int64_t>::Hash(k); },
              [](int64_t id) { return id; }, ids);
      PartitionDistinct(t.t64->table(), ids, &ids->keys64);
    } else {
      EveryId(cfg, p, features,
              [](int64_t k) { return kv::Table<int32_t>::Hash(static_cast<int32_t>(k)); },
              [](int64_t id) { return static_cast<int64_t>(static_cast<int32_t>(id)); }, ids);
      PartitionDistinct(t.t32->table(), ids, &ids->keys32);
    }
    return;
  }
  if (!cfg.is_table(p)) {
    Dedupe(cfg, p, features, false,
           [](int64_t k) { return kv::HashKey(static_cast<uint64_t>(k)); },
           [](int64_t id) { return id; }, ids);
    return;
  }
  const TableSlot& t = tables[p];
  if (t.t64) {
    Dedupe(cfg, p, features, t.filtered(),
           [](int64_t k) { return kv::Table<int64_t>::Hash(k); },
           [](int64_t id) { return id; }, ids);
    PartitionDistinct(t.t64->table(), ids, &ids->keys64);
  } else {
    Dedupe(cfg, p, features, t.filtered(),
           [](int64_t k) { return kv::Table<int32_t>::Hash(static_cast<int32_t>(k)); },
           [](int64_t id) { return static_cast<int64_t>(static_cast<int32_t>(id)); },
           ids);
    PartitionDistinct(t.t32->table(), ids, &ids->keys32);
  }
}

// On the single-id fast path, when table p serves one feature whose rows are
// plain copies (no weights, no max_norm) and whose output rows start at
// multiples of dim (always without concat; with concat when every width is
// a multiple of dim), points the lookup straight at the output: order[j]
// becomes the output position of key j, in units of dim. Returns whether
// it did (the feature then needs no combine pass).
bool DirectOutput(OpKernelContext* ctx, const GroupConfig& cfg, int p,
                  const std::vector<float*>& outs, ParamIds* ids) {
  if (ids->distinct || cfg.features_of[p].size() != 1) return false;
  const int f = cfg.features_of[p][0];
  const int64_t dim = cfg.dims[p];
  const int64_t stride = cfg.row_stride(f);
  const int64_t col = cfg.concat ? cfg.feature[f].column : 0;
  if (cfg.feature[f].max_norm > 0 || ctx->input(cfg.weights_input(f)).dim_size(0) != 0 ||
      stride % dim != 0 || col % dim != 0) {
    return false;
  }
  const int64_t step = stride / dim;
  for (int64_t& o : ids->order) o = o * step + col / dim;
  ids->direct_out = cfg.concat ? outs[0] : outs[f];
  return true;
}

// Sizes table t's row buffer for up to n distinct keys (called on the op's
// own thread, before the parallel units).
absl::Status PrepareRows(OpKernelContext* ctx, const GroupConfig& cfg, int t, int64_t n,
                         ParamIds* ids) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_FLOAT, TensorShape({n, cfg.dims[t]}),
                                        &ids->rows_buffer));
  ids->rows = ids->rows_buffer.flat<float>().data();
  return absl::OkStatus();
}

// Sizes table t's per-key buffers for its distinct keys.
void PrepareSkips(ParamIds* ids) {
  ids->skips.assign(ids->uniq.size(), 0);
}

// Reads the rows of table t's distinct keys of shard sh (PrepareRows first).
void LookupShard(const std::vector<TableSlot>& tables, int t, int sh, bool insert,
                 ParamIds* ids) {
  const int64_t b = ids->offsets[sh];
  const int64_t n = ids->offsets[sh + 1] - b;
  if (n == 0) return;
  if (!ids->distinct) {  // the single-id fast path: every occurrence looked up
    float* out = ids->direct_out != nullptr ? ids->direct_out : ids->rows;
    if (tables[t].t64) {
      tables[t].t64->table().Lookup(sh, ids->keys64.data() + b, ids->part_hashes.data() + b,
                                    ids->order.data() + b, n, insert, out);
    } else {
      tables[t].t32->table().Lookup(sh, ids->keys32.data() + b, ids->part_hashes.data() + b,
                                    ids->order.data() + b, n, insert, out);
    }
    return;
  }
  if (tables[t].t64) {
    tables[t].t64->table().LookupCounted(sh, ids->keys64.data() + b,
                                         ids->part_hashes.data() + b, ids->order.data() + b,
                                         ids->counts.data(), n, insert, ids->rows,
                                         ids->skips.data());
  } else {
    tables[t].t32->table().LookupCounted(sh, ids->keys32.data() + b,
                                         ids->part_hashes.data() + b, ids->order.data() + b,
                                         ids->counts.data(), n, insert, ids->rows,
                                         ids->skips.data());
  }
}

// Reads the row of every distinct key of the wanted tables into rows, one
// unit per (table, shard); with `insert` (training) each key counts as
// often as it occurs.
absl::Status LookupDistinct(OpKernelContext* ctx, const GroupConfig& cfg,
                            const std::vector<TableSlot>& tables,
                            std::vector<ParamIds>* params, bool insert,
                            const std::vector<bool>& wanted) {
  std::vector<std::pair<int, int>> units;
  int64_t total = 0;
  for (int t = 0; t < cfg.num_tables; ++t) {
    if (!wanted[t]) continue;
    ParamIds& ids = (*params)[t];
    if (ids.rows == nullptr) {
      TF_RETURN_IF_ERROR(
          PrepareRows(ctx, cfg, t, static_cast<int64_t>(ids.uniq.size()), &ids));
    }
    PrepareSkips(&ids);
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

// The row that entry j of feature f reads (parameter p).
inline const float* RowOf(OpKernelContext* ctx, const GroupConfig& cfg,
                          const std::vector<TableSlot>& tables,
                          const std::vector<ParamIds>& params, const Feature& ft, int p,
                          int64_t j) {
  const int64_t dim = cfg.dims[p];
  if (!cfg.is_table(p)) return ctx->input(p).flat<float>().data() + ft.ids[j] * dim;
  const ParamIds& ids = params[p];
  const int32_t u = ft.inverse[j];
  if (!ft.rank.empty() && ft.rank[j] < ids.skips[u]) return tables[p].NoPermissionRow();
  return ids.rows + static_cast<int64_t>(u) * dim;
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

// Writes rows [begin, end) of feature f's output from its parameter's rows.
void CombineRows(OpKernelContext* ctx, const GroupConfig& cfg,
                 const std::vector<TableSlot>& tables, const std::vector<ParamIds>& params,
                 const std::vector<Feature>& features, int f, int64_t begin, int64_t end,
                 float* out) {
  const Feature& ft = features[f];
  const int p = cfg.feature[f].param;
  const int64_t dim = cfg.dims[p];
  const float max_norm = cfg.feature[f].max_norm;
  const int64_t stride = cfg.row_stride(f);
  // Output rows that are whole aligned cache lines (a concatenated output's
  // columns of dim 16, 32, ...) are built in `acc` and streamed, as
  // CombinePooled's: a plain store would first read the line, cold in an
  // output of F features' columns. Measured (training, 26 features of dim
  // 16, 1 id per row, 1 thread): this function's share of the step 9.1% ->
  // 5.2%, the step ~5% faster.
  constexpr int64_t kMaxStreamedDim = 256;
  const bool stream = !cfg.feature[f].sequence && dim <= kMaxStreamedDim &&
                      kv::StreamableRows(out, dim, stride);
  alignas(64) float acc[kMaxStreamedDim];
  for (int64_t b = begin; b < end; ++b) {
    if (cfg.feature[f].sequence) {
      float* o = out + b * ft.max_len * dim;
      std::fill(o, o + ft.max_len * dim, 0.0f);
      for (int64_t j = ft.splits[b]; j < ft.splits[b + 1]; ++j, o += dim) {
        const float* row = RowOf(ctx, cfg, tables, params, ft, p, j);
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
      const float* row = RowOf(ctx, cfg, tables, params, ft, p, j0);
      const float s = cfg.feature[f].combiner == kSum    ? w
                      : w == 0                    ? 0.0f
                      : cfg.feature[f].combiner == kMean ? 1.0f
                      : (w > 0 ? 1.0f : -1.0f);
      for (int64_t d = 0; d < dim; ++d) o[d] = s * row[d];
      if (stream) kv::StreamRow(dst, acc, dim);
      continue;
    }
    std::fill(o, o + dim, 0.0f);
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = RowOf(ctx, cfg, tables, params, ft, p, j);
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

// The lean single-id path (inference with `lean_single_id`, the op's
// default, or `single_id`): a feature that is
// its table's only feature, with one id per row as given (row_splits 0, 1,
// ..., B; no weights; no id pruned), no max_norm and output rows at
// multiples of dim, is read straight from its ids input: no copy of its
// ids, no deduplication, no combine pass; each id is hashed once, its keys
// are grouped by shard and each shard's lookup writes rows into the output.
// (One id of weight 1 gives its row under every combiner; default_id never
// applies.)
bool LeanFeature(OpKernelContext* ctx, const GroupConfig& cfg, bool insert, int f) {
  const FeatureAttrs& a = cfg.feature[f];
  if (!(cfg.single_id || cfg.lean_single_id) || insert || !cfg.is_table(a.param) ||
      cfg.features_of[a.param].size() != 1 || a.sequence || a.max_norm > 0) {
    return false;
  }
  const Tensor& ids_t = ctx->input(cfg.ids_input(f));
  const Tensor& splits_t = ctx->input(cfg.splits_input(f));
  const Tensor& weights_t = ctx->input(cfg.weights_input(f));
  if (ids_t.dims() != 1 || splits_t.dims() != 1 || weights_t.dims() != 1 ||
      weights_t.dim_size(0) != 0 || splits_t.dim_size(0) != ids_t.dim_size(0) + 1) {
    return false;
  }
  const int64_t dim = cfg.dims[a.param];
  if (cfg.row_stride(f) % dim != 0 || (cfg.concat ? a.column : 0) % dim != 0) return false;
  const int64_t n = ids_t.dim_size(0);
  const int64_t* splits = splits_t.flat<int64_t>().data();
  for (int64_t b = 0; b <= n; ++b) {
    if (splits[b] != b) return false;
  }
  if (a.prune) {
    const int64_t* ids = ids_t.flat<int64_t>().data();
    for (int64_t j = 0; j < n; ++j) {
      if (ids[j] < 0) return false;
    }
  }
  return true;
}

// The lean path's partition of feature f's ids (table p = its parameter):
// writes unique_ids (every id, as its key) and inverse (0, 1, ...), and
// groups the keys by shard with their output positions (units of dim) for
// LookupShard, which then writes into `out`.
template <typename K>
void LeanPartition(const kv::Table<K>& table, const GroupConfig& cfg, int f, const int64_t* ids,
                   int64_t n, float* out, int64_t* unique, int32_t* inverse, std::vector<K>* keys,
                   ParamIds* pid) {
  const int64_t dim = cfg.dims[cfg.feature[f].param];
  const int64_t step = cfg.row_stride(f) / dim;
  const int64_t col = cfg.concat ? cfg.feature[f].column / dim : 0;
  pid->distinct = false;
  pid->direct_out = out;
  pid->hashes.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    const K k = static_cast<K>(ids[j]);
    unique[j] = static_cast<int64_t>(k);
    inverse[j] = static_cast<int32_t>(j);
    pid->hashes[j] = kv::Table<K>::Hash(k);
  }
  SortByShard(
      table, n, [&](int64_t j) { return static_cast<K>(ids[j]); },
      [&](int64_t j) { return j * step + col; }, pid, keys);
}

// The lean path looks up through kv::Table::LookupOrdered where the table
// prefers it (as the single table lookup does), in blocks of this many ids
// when a parameter's ids are split over units.
constexpr int64_t kLeanOrderedBlock = kv::Table<int64_t>::kOrderedBlock;

// The lean path's ordered lookup of ids [begin, end) of parameter p.
void LeanOrderedLookup(const std::vector<TableSlot>& tables, int p, ParamIds* pid,
                       int64_t begin, int64_t end) {
  if (begin >= end) return;
  float* out = pid->direct_out + begin * pid->ordered_stride;
  if (tables[p].t64) {
    tables[p].t64->table().LookupOrdered(pid->ordered_keys64 + begin, end - begin,
                                         /*insert=*/false, out, pid->ordered_stride);
  } else {
    tables[p].t32->table().LookupOrdered(pid->keys32.data() + begin, end - begin,
                                         /*insert=*/false, out, pid->ordered_stride);
  }
}

void LeanPartitionParam(OpKernelContext* ctx, const GroupConfig& cfg,
                        const std::vector<TableSlot>& tables, int p,
                        const std::vector<float*>& outs, int64_t* unique, int32_t* inverse,
                        ParamIds* pid) {
  const int f = cfg.features_of[p][0];
  const Tensor& ids_t = ctx->input(cfg.ids_input(f));
  const int64_t* ids = ids_t.flat<int64_t>().data();
  const int64_t n = ids_t.dim_size(0);
  float* out = cfg.concat ? outs[0] : outs[f];
  const bool ordered = tables[p].PrefersOrderedLookup(n);
  if (ordered) {
    // No partition: unique_ids and inverse, then LeanOrderedLookup.
    pid->distinct = false;
    pid->ordered = true;
    pid->num_ordered = n;
    pid->ordered_stride = cfg.row_stride(f);
    pid->direct_out = out + (cfg.concat ? cfg.feature[f].column : 0);
    if (tables[p].t64) {
      pid->ordered_keys64 = ids;
      std::copy(ids, ids + n, unique);
    } else {
      pid->keys32.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        pid->keys32[j] = static_cast<int32_t>(ids[j]);
        unique[j] = pid->keys32[j];
      }
    }
    for (int64_t j = 0; j < n; ++j) inverse[j] = static_cast<int32_t>(j);
    return;
  }
  if (tables[p].t64) {
    LeanPartition(tables[p].t64->table(), cfg, f, ids, n, out, unique, inverse, &pid->keys64,
                  pid);
  } else {
    LeanPartition(tables[p].t32->table(), cfg, f, ids, n, out, unique, inverse, &pid->keys32,
                  pid);
  }
}

// The lean pooled path (inference with `lean_pooled`, the op's default, or
// `single_id`): table p serves one feature, not a sequence feature, without
// weights or max_norm, and is not on the lean single-id path. Its ids (after
// BuildFeature's pruning and default filling) are not deduplicated: every
// kept id is its own entry (unique_ids lists them, repeats too; inverse is
// 0, 1, ...), looked up in batch order into the parameter's row buffer, and
// CombineRows sums each row's ids in their order as on the general path, so
// the outputs are bit-identical (an id's row is the same whether it is read
// once or once per occurrence without `insert`).
bool LeanPooledParam(OpKernelContext* ctx, const GroupConfig& cfg, bool insert, int p) {
  if (!(cfg.single_id || cfg.lean_pooled) || insert || !cfg.is_table(p) ||
      cfg.features_of[p].size() != 1) {
    return false;
  }
  const int f = cfg.features_of[p][0];
  const FeatureAttrs& a = cfg.feature[f];
  return !a.sequence && a.max_norm <= 0 && ctx->input(cfg.weights_input(f)).dim_size(0) == 0;
}

// The lean pooled path's ids of table p (its rows buffer prepared): every
// kept id of its feature in batch order, set up for LeanOrderedLookup into
// the rows buffer when the table allows it, else partitioned by shard for
// LookupShard.
void LeanPooledIds(const GroupConfig& cfg, const std::vector<TableSlot>& tables, int p,
                   bool ordered, std::vector<Feature>* features, ParamIds* pid) {
  const int f = cfg.features_of[p][0];
  Feature& ft = (*features)[f];
  const int64_t n = ft.kept();
  pid->distinct = false;
  const TableSlot& t = tables[p];
  for (int64_t j = 0; j < n; ++j) ft.inverse[j] = static_cast<int32_t>(j);
  if (ft.given) {  // the ids input, also the unique_ids output (int64 keys, ordered)
    pid->ordered = true;
    pid->num_ordered = n;
    pid->ordered_keys64 = ft.given;
    return;
  }
  // Every kept id in batch order: a feature built in place (BuildFeature's
  // `in_place`, always ordered) straight into its unique_ids output, else
  // in uniq (its ids are not read again: rows come through inverse).
  int64_t* keys;
  if (ft.raw) {
    keys = pid->raw_out;
    std::copy(ft.raw.get(), ft.raw.get() + n, keys);
  } else {
    pid->uniq.swap(ft.ids);
    keys = pid->uniq.data();
  }
  if (t.t32) {
    pid->keys32.resize(n);
    for (int64_t j = 0; j < n; ++j) {
      pid->keys32[j] = static_cast<int32_t>(keys[j]);
      keys[j] = pid->keys32[j];
    }
  }
  if (ordered) {  // LeanPooledRows looks up and combines
    pid->ordered = true;
    pid->num_ordered = n;
    pid->ordered_keys64 = keys;
    return;
  }
  pid->hashes.resize(n);
  if (t.t64) {
    for (int64_t j = 0; j < n; ++j) pid->hashes[j] = kv::Table<int64_t>::Hash(pid->uniq[j]);
    PartitionDistinct(t.t64->table(), pid, &pid->keys64);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      pid->hashes[j] = kv::Table<int32_t>::Hash(pid->keys32[j]);
    }
    PartitionDistinct(t.t32->table(), pid, &pid->keys32);
  }
}

// The lean pooled path with kv::Table::OrderedReader: rows [begin, end) of
// table p's feature, in blocks of about kLeanPooledBlock ids, each block's
// rows found (pointers into the table, prefetched) and then combined
// straight from the table, as CombineRows does (ids of a row in order; one
// id of weight 1 gives its row under every combiner; several are summed
// from 0 and scaled by 1 / n (mean) or 1 / sqrt(n) (sqrtn), n the float sum
// of their weights 1; an empty row gives zeros).
constexpr int64_t kLeanPooledBlock = 1024;

template <typename K>
void LeanPooledRowsOf(kv::Table<K>& table, const Feature& ft, const K* keys, int64_t dim,
                      Combiner comb, int64_t begin, int64_t end, float* out, int64_t stride) {
  thread_local std::vector<const float*> rows;
  typename kv::Table<K>::OrderedReader reader(table);
  const bool padded = PadPooledRows(ft.max_len, ft.batch, ft.kept());
  int64_t b0 = begin;
  while (b0 < end) {
    const int64_t j0 = ft.splits[b0];
    int64_t b1 = b0 + 1;
    while (b1 < end && ft.splits[b1 + 1] - j0 <= kLeanPooledBlock) ++b1;
    const int64_t j1 = ft.splits[b1];
    // One slot more: the pad row.
    if (static_cast<int64_t>(rows.size()) < j1 - j0 + 1) rows.resize(j1 - j0 + 1);
    reader.Find(keys + j0, j1 - j0, rows.data(), /*read_later=*/true);
    rows[j1 - j0] = kNegativeZeros.data();
    CombinePooledRows(dim, ft.splits.data(), j0, b0, b1, rows.data(), padded, j1 - j0,
                      ft.max_len, comb, out, stride);
    b0 = b1;
  }
  kv::StreamFence();  // the streamed stores are ordered before the op completes
}

void LeanPooledRows(const GroupConfig& cfg, const std::vector<TableSlot>& tables,
                    const std::vector<Feature>& features, int p, ParamIds* pid, int64_t begin,
                    int64_t end, float* out) {
  const int f = cfg.features_of[p][0];
  const Feature& ft = features[f];
  const int64_t dim = cfg.dims[p];
  const int64_t stride = cfg.row_stride(f);
  const Combiner comb = cfg.feature[f].combiner;
  if (tables[p].t64) {
    LeanPooledRowsOf(tables[p].t64->table(), ft, pid->ordered_keys64, dim, comb, begin, end, out,
                     stride);
  } else {
    LeanPooledRowsOf(tables[p].t32->table(), ft, pid->keys32.data(), dim, comb, begin, end, out,
                     stride);
  }
}

// The combine pass of the forward (features not written by their lookups):
// units of kCombineRows rows of one feature, feature by feature (each
// parameter's rows stay in cache while its features read them; measured
// no faster row-block-major over all features).
constexpr int64_t kCombineRows = 256;

absl::Status CombineBlocks(OpKernelContext* ctx, const GroupConfig& cfg,
                           const std::vector<TableSlot>& tables,
                           const std::vector<ParamIds>& params,
                           const std::vector<Feature>& features,
                           const std::vector<bool>& combined, const std::vector<float*>& outs) {
  std::vector<std::pair<int, int64_t>> units;
  for (size_t f = 0; f < features.size(); ++f) {
    if (!combined[f]) continue;
    for (int64_t b = 0; b < features[f].batch; b += kCombineRows) {
      units.emplace_back(static_cast<int>(f), b);
    }
  }
  return ParallelFor(ctx, static_cast<int64_t>(units.size()), kCombineRows * 200,
                     [&](int64_t u) {
                       const int f = units[u].first;
                       const int64_t begin = units[u].second;
                       CombineRows(ctx, cfg, tables, params, features, f, begin,
                                   std::min(features[f].batch, begin + kCombineRows), outs[f]);
                     });
}

class GroupLookupOp : public OpKernel {
 public:
  explicit GroupLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("insert", &insert_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("single_id", &cfg_.single_id));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lean_single_id", &cfg_.lean_single_id));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lean_pooled", &cfg_.lean_pooled));
    // Training keeps the dedupe: without it the backward and the
    // optimizer's apply get every occurrence instead of each key once, and
    // with a filter the table's Lookup groups equal keys itself; measured
    // (benchmarks/fit_epoch.py, group_general vs group), a training step
    // took ~15% more CPU with the fast path.
    cfg_.single_id = cfg_.single_id && !insert_;
  }

  void Compute(OpKernelContext* ctx) override {
    const GroupConfig& cfg = cfg_;
    const int F = cfg.num_features;
    const int P = cfg.num_params();
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    // Lean features (see LeanFeature) skip BuildFeature: their ids are
    // read from the input as they are.
    std::vector<char> lean(F, 0), lean_param(P, 0);
    for (int f = 0; f < F; ++f) {
      lean[f] = LeanFeature(ctx, cfg, insert_, f);
      if (lean[f]) lean_param[cfg.feature[f].param] = 1;
    }
    // Tables on the lean pooled path (see LeanPooledParam); those whose
    // whole ids input would go through LookupOrdered may read it in place.
    std::vector<char> pooled(P, 0), in_place(F, 0);
    for (int p = 0; p < cfg.num_tables; ++p) {
      pooled[p] = !lean_param[p] && LeanPooledParam(ctx, cfg, insert_, p);
      if (!pooled[p]) continue;
      const int f = cfg.features_of[p][0];
      const int64_t nnz = ctx->input(cfg.ids_input(f)).dim_size(0);
      in_place[f] = tables[p].PrefersOrderedLookup(nnz);
    }
    std::vector<Feature> features(F);
    {
      std::vector<absl::Status> status(F);
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, F, 1000, [&](int64_t f) {
        if (lean[f]) {
          features[f].batch = ctx->input(cfg.ids_input(static_cast<int>(f))).dim_size(0);
          features[f].max_len = 1;
        } else {
          status[f] = BuildFeature(ctx, cfg, static_cast<int>(f), &features[f], in_place[f]);
        }
      }));
      for (const auto& st : status) OP_REQUIRES_OK(ctx, st);
    }
    std::vector<float*> outs(F);
    for (int f = 0; f < F; ++f) {
      Tensor* inv;
      const int64_t kept = lean[f] ? features[f].batch : features[f].kept();
      OP_REQUIRES_OK(ctx, ctx->allocate_output(F + P + f, TensorShape({kept}), &inv));
      features[f].inverse = inv->flat<int32_t>().data();
      if (cfg.concat) {
        OP_REQUIRES(ctx, features[f].batch == features[0].batch,
                    errors::InvalidArgument("concat = true needs one batch size, but feature ", f,
                                            " has ", features[f].batch, " rows and feature 0 ",
                                            features[0].batch));
        if (f == 0) {
          Tensor* out;
          OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({features[0].batch, cfg.width}),
                                                   &out));
          outs[0] = out->flat<float>().data();
        } else {
          Tensor* empty;
          OP_REQUIRES_OK(ctx, ctx->allocate_output(f, TensorShape({0}), &empty));
        }
        continue;
      }
      const int64_t dim = cfg.dims[cfg.feature[f].param];
      TensorShape shape = cfg.feature[f].sequence
                              ? TensorShape({features[f].batch, features[f].max_len, dim})
                              : TensorShape({features[f].batch, dim});
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(f, shape, &out));
      outs[f] = out->flat<float>().data();
    }
    if (cfg.concat) {
      for (int f = F - 1; f >= 0; --f) outs[f] = outs[0] + cfg.feature[f].column;
    }
    std::vector<ParamIds> params(P);
    std::vector<bool> combined(F, true);
    // Lean parameters' unique_ids, allocated here (every id, in order).
    std::vector<int64_t*> lean_unique(P, nullptr);
    for (int p = 0; p < P; ++p) {
      if (!lean_param[p]) continue;
      const int f = cfg.features_of[p][0];
      combined[f] = false;
      Tensor* u;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(F + p, TensorShape({features[f].batch}), &u));
      lean_unique[p] = u->flat<int64_t>().data();
    }
    for (int p = 0; p < cfg.num_tables; ++p) {  // pooled features read in place
      const int f = cfg.features_of[p][0];
      if (!pooled[p] || !features[f].in_place()) continue;
      if (features[f].given) {  // unique_ids: the ids input as it is
        ctx->set_output(F + p, ctx->input(cfg.ids_input(f)));
        params[p].unique_set = true;
        continue;
      }
      Tensor* u;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              F + p, TensorShape({features[f].num_raw}), &u));
      params[p].raw_out = u->flat<int64_t>().data();
      params[p].unique_set = true;
    }
    // Decided once here (the table's size may change under a concurrent
    // training lookup): the ordered ones need no row buffer.
    std::vector<char> pooled_ordered(P, 0);
    for (int p = 0; p < cfg.num_tables; ++p) {
      if (!pooled[p]) continue;
      const Feature& ft = features[cfg.features_of[p][0]];
      const int64_t n = ft.kept();
      pooled_ordered[p] = ft.in_place() || tables[p].PrefersOrderedLookup(n);
    }
    auto lean_partition = [&](int p) {
      const int f = cfg.features_of[p][0];
      LeanPartitionParam(ctx, cfg, tables, p, outs, lean_unique[p], features[f].inverse,
                         &params[p]);
    };
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    if (P >= 2 * threads) {
      // Enough parameters to keep every thread busy: one unit per parameter
      // deduplicates (or lean-partitions), looks up and combines its
      // features, so the op waits on the pool once rather than once per
      // phase, and a parameter's rows are combined while in cache.
      int64_t total = 0;
      for (const Feature& ft : features) total += ft.batch;
      for (int p = 0; p < cfg.num_tables; ++p) {  // room for every id: none repeats
        if (lean_param[p] || pooled_ordered[p]) continue;
        int64_t n = 0;
        for (int f : cfg.features_of[p]) n += static_cast<int64_t>(features[f].ids.size());
        OP_REQUIRES_OK(ctx, PrepareRows(ctx, cfg, p, n, &params[p]));
      }
      const int64_t cost = 200 * (total / P + 1);
      // Every other call goes through the parameters in reverse order: the
      // tables read last by one call are read first by the next, while still
      // in the last-level cache (all of a group's tables often exceed it:
      // 26 tables of 15.5k keys, dim 16, ~40 MB; a cyclic walk over more than
      // the cache misses on almost every line). Measured (multi, 1 thread,
      // op alone, interleaved A/B): 0.96x CPU alone, 0.90x with
      // CombinePooled.
      const bool reverse = calls_.fetch_add(1, std::memory_order_relaxed) & 1;
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, P, cost, [&](int64_t p64) {
        const int p = static_cast<int>(reverse ? P - 1 - p64 : p64);
        ParamIds& ids = params[p];
        if (lean_param[p]) {
          lean_partition(p);
        } else if (pooled[p]) {
          LeanPooledIds(cfg, tables, p, pooled_ordered[p], &features, &ids);
        } else {
          DedupeParam(cfg, tables, p, &features, &ids);
        }
        if (pooled[p] && ids.ordered) {
          const int f = cfg.features_of[p][0];
          LeanPooledRows(cfg, tables, features, p, &ids, 0, features[f].batch, outs[f]);
          return;
        }
        const bool direct =
            lean_param[p] || (!pooled[p] && DirectOutput(ctx, cfg, p, outs, &ids));
        if (ids.ordered) {
          LeanOrderedLookup(tables, p, &ids, 0, ids.num_ordered);
        } else if (cfg.is_table(p)) {
          PrepareSkips(&ids);
          for (int sh = 0; sh < tables[p].num_shards(); ++sh) {
            LookupShard(tables, p, sh, insert_, &ids);
          }
        }
        if (direct) return;
        for (int f : cfg.features_of[p]) {
          CombineRows(ctx, cfg, tables, params, features, f, 0, features[f].batch, outs[f]);
        }
      }));
    } else {
      int64_t total = 0;
      for (const Feature& ft : features) total += ft.batch;
      for (int p = 0; p < cfg.num_tables; ++p) {
        if (!pooled[p] || pooled_ordered[p]) continue;
        const int64_t n = static_cast<int64_t>(features[cfg.features_of[p][0]].ids.size());
        OP_REQUIRES_OK(ctx, PrepareRows(ctx, cfg, p, n, &params[p]));
      }
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, P, 30 * (total / P + 1), [&](int64_t p64) {
        const int p = static_cast<int>(p64);
        if (lean_param[p]) {
          lean_partition(p);
        } else if (pooled[p]) {
          LeanPooledIds(cfg, tables, p, pooled_ordered[p], &features, &params[p]);
        } else {
          DedupeParam(cfg, tables, p, &features, &params[p]);
        }
      }));
      for (int p = 0; p < cfg.num_tables; ++p) {
        if (!lean_param[p] && !pooled[p] && DirectOutput(ctx, cfg, p, outs, &params[p])) {
          combined[cfg.features_of[p][0]] = false;
        }
      }
      std::vector<bool> wanted(cfg.num_tables, true);
      std::vector<std::pair<int, int64_t>> ordered_units;  // (parameter, first id)
      for (int p = 0; p < cfg.num_tables; ++p) {
        if (!params[p].ordered) continue;
        wanted[p] = false;
        if (pooled[p]) {  // units of rows: LeanPooledRows looks up and combines
          const int f = cfg.features_of[p][0];
          combined[f] = false;
          const int64_t rows_per_unit =
              std::max<int64_t>(64, kLeanOrderedBlock * features[f].batch /
                                        std::max<int64_t>(1, params[p].num_ordered));
          for (int64_t b = 0; b < features[f].batch; b += rows_per_unit) {
            ordered_units.emplace_back(p, -1 - b);
          }
          continue;
        }
        for (int64_t b = 0; b < params[p].num_ordered; b += kLeanOrderedBlock) {
          ordered_units.emplace_back(p, b);
        }
      }
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, static_cast<int64_t>(ordered_units.size()),
                                      kLeanOrderedBlock * 60, [&](int64_t u) {
        const int p = ordered_units[u].first;
        const int64_t b = ordered_units[u].second;
        if (b < 0) {  // a pooled feature's rows from -1 - b
          const int f = cfg.features_of[p][0];
          const int64_t rows_per_unit =
              std::max<int64_t>(64, kLeanOrderedBlock * features[f].batch /
                                        std::max<int64_t>(1, params[p].num_ordered));
          const int64_t r = -1 - b;
          LeanPooledRows(cfg, tables, features, p, &params[p], r,
                         std::min(features[f].batch, r + rows_per_unit), outs[f]);
          return;
        }
        LeanOrderedLookup(tables, p, &params[p], b,
                          std::min(params[p].num_ordered, b + kLeanOrderedBlock));
      }));
      OP_REQUIRES_OK(ctx, LookupDistinct(ctx, cfg, tables, &params, insert_, wanted));
      OP_REQUIRES_OK(ctx, CombineBlocks(ctx, cfg, tables, params, features, combined, outs));
    }
    for (int p = 0; p < P; ++p) {
      if (lean_param[p] || params[p].unique_set) continue;
      Tensor* u;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              F + p, TensorShape({static_cast<int64_t>(params[p].uniq.size())}),
                              &u));
      std::copy(params[p].uniq.begin(), params[p].uniq.end(), u->flat<int64_t>().data());
    }
  }

 private:
  GroupConfig cfg_;
  bool insert_;
  std::atomic<uint64_t> calls_{0};  // Compute calls (see `reverse`)
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookup").Device(tf::DEVICE_CPU), GroupLookupOp);

class GroupLookupGradOp : public OpKernel {
 public:
  explicit GroupLookupGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    const GroupConfig& cfg = cfg_;
    const int P = cfg.num_params();
    const int F = cfg.num_features;
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    std::vector<Feature> features;
    OP_REQUIRES_OK(ctx, BuildFeatures(ctx, cfg, &features));
    const int uniq0 = P + 3 * F, inverse0 = uniq0 + P, grads0 = inverse0 + F;
    std::vector<ParamIds> params(P);
    for (int p = 0; p < P; ++p) {
      const Tensor& u = ctx->input(uniq0 + p);
      OP_REQUIRES_OK(ctx, validate::Vector(u, ("unique_ids[" + std::to_string(p) + "]").c_str()));
      const int64_t* d = u.flat<int64_t>().data();
      params[p].uniq.assign(d, d + u.dim_size(0));
    }
    std::vector<const float*> grads(F);
    for (int f = 0; f < F; ++f) {
      Feature& ft = features[f];
      const int p = cfg.feature[f].param;
      const Tensor& inv = ctx->input(inverse0 + f);
      const std::string inv_name = "inverse[" + std::to_string(f) + "]";
      // One entry per id kept after pruning and default filling.
      OP_REQUIRES_OK(ctx, validate::Vector(inv, (inv_name + " (one entry per looked-up id)").c_str(),
                                           static_cast<int64_t>(ft.ids.size())));
      ft.inverse = const_cast<int32_t*>(inv.flat<int32_t>().data());
      const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
      OP_REQUIRES_OK(ctx, validate::InRange(ft.inverse, static_cast<int64_t>(ft.ids.size()),
                                            0, num_uniq, inv_name));
      if (cfg.concat && f > 0) {
        OP_REQUIRES(ctx, ft.batch == features[0].batch,
                    errors::InvalidArgument("concat = true needs one batch size, but feature ", f,
                                            " has ", ft.batch, " rows and feature 0 ",
                                            features[0].batch));
        grads[f] = grads[0] + cfg.feature[f].column;
        continue;
      }
      const Tensor& g = ctx->input(grads0 + f);
      const int64_t dim = cfg.concat ? cfg.width : cfg.dims[p];
      const TensorShape want = cfg.feature[f].sequence ? TensorShape({ft.batch, ft.max_len, dim})
                                               : TensorShape({ft.batch, dim});
      OP_REQUIRES(ctx, g.shape() == want,
                  errors::InvalidArgument("output_grads[", f, "] must be ",
                                          want.DebugString(), ", got ",
                                          g.shape().DebugString()));
      grads[f] = g.flat<float>().data();
    }
    // Rows are needed only to differentiate the max_norm clip.
    std::vector<bool> wanted(cfg.num_tables, false);
    for (int f = 0; f < F; ++f) {
      const int p = cfg.feature[f].param;
      if (cfg.is_table(p) && cfg.feature[f].max_norm > 0) wanted[p] = true;
    }
    for (int t = 0; t < cfg.num_tables; ++t) {
      if (!wanted[t]) continue;
      ParamIds& ids = params[t];
      ids.hashes.resize(ids.uniq.size());
      for (size_t u = 0; u < ids.uniq.size(); ++u) ids.hashes[u] = tables[t].Hash(ids.uniq[u]);
      if (tables[t].t64) {
        PartitionDistinct(tables[t].t64->table(), &ids, &ids.keys64);
      } else {
        PartitionDistinct(tables[t].t32->table(), &ids, &ids.keys32);
      }
      ids.counts.assign(ids.uniq.size(), 1);
    }
    OP_REQUIRES_OK(ctx, LookupDistinct(ctx, cfg, tables, &params, false, wanted));

    // Units: (parameter, range of distinct ids); a unit scans all ids of
    // its parameter and sums those in its range, so no two units write the
    // same row.
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    std::vector<int> num_ranges(P), first_unit(P + 1, 0);
    std::vector<float*> outs(P);
    for (int p = 0; p < P; ++p) {
      const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(p, TensorShape({num_uniq, cfg.dims[p]}), &out));
      outs[p] = out->flat<float>().data();  // each unit zeroes its rows
      num_ranges[p] = static_cast<int>(
          std::max<int64_t>(1, std::min<int64_t>(threads, num_uniq / 16384)));
      first_unit[p + 1] = first_unit[p] + num_ranges[p];
    }
    std::vector<int> unit_param(first_unit[P]);
    for (int p = 0; p < P; ++p) {
      for (int u = first_unit[p]; u < first_unit[p + 1]; ++u) unit_param[u] = p;
    }
    int64_t total = 0;
    for (const Feature& ft : features) total += static_cast<int64_t>(ft.ids.size());
    const int64_t cost = 20 * (total / std::max(1, first_unit[P]) + 1);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, first_unit[P], cost, [&](int64_t unit) {
      const int p = unit_param[unit];
      const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
      const int r = static_cast<int>(unit - first_unit[p]);
      const int64_t lo = num_uniq * r / num_ranges[p];
      const int64_t hi = num_uniq * (r + 1) / num_ranges[p];
      std::fill(outs[p] + lo * cfg.dims[p], outs[p] + hi * cfg.dims[p], 0.0f);
      Accumulate(ctx, cfg, tables, params, features, grads, p, lo, hi, outs[p]);
    }));
  }

 private:
  static void Accumulate(OpKernelContext* ctx, const GroupConfig& cfg,
                         const std::vector<TableSlot>& tables,
                         const std::vector<ParamIds>& params,
                         const std::vector<Feature>& features,
                         const std::vector<const float*>& grads, int p, int64_t lo,
                         int64_t hi, float* out) {
    const int64_t dim = cfg.dims[p];
    std::vector<float> g(dim);
    // Rows of a pooled feature's output gradient lie row_stride apart (the
    // whole concat row with `concat`): prefetched kAhead rows ahead, since
    // the hardware prefetcher loses such strides at page boundaries.
    constexpr int64_t kAhead = 8;
    for (int f : cfg.features_of[p]) {
      const Feature& ft = features[f];
      const float max_norm = cfg.feature[f].max_norm;
      const bool sequence = cfg.feature[f].sequence;
      const int64_t stride = sequence ? 0 : cfg.row_stride(f);
      for (int64_t b = 0; b < ft.batch; ++b) {
        if (!sequence && b + kAhead < ft.batch) {
          const float* ahead = grads[f] + (b + kAhead) * stride;
          __builtin_prefetch(ahead);
          __builtin_prefetch(ahead + dim - 1);
        }
        const int64_t begin = ft.splits[b], end = ft.splits[b + 1];
        if (begin == end) continue;
        float c = -1.0f;  // computed on first use
        for (int64_t j = begin; j < end; ++j) {
          const int64_t u = ft.inverse[j];
          if (u < lo || u >= hi) continue;
          if (c < 0) c = cfg.feature[f].sequence ? 1.0f : CombinerScale(ft, cfg.feature[f].combiner, b);
          const float* dout = cfg.feature[f].sequence ? grads[f] + (b * ft.max_len + (j - begin)) * dim
                                              : grads[f] + b * cfg.row_stride(f);
          const float s = c * ft.weights[j];
          float* acc = out + u * dim;
          if (max_norm <= 0) {
            for (int64_t d = 0; d < dim; ++d) acc[d] += s * dout[d];
            continue;
          }
          for (int64_t d = 0; d < dim; ++d) g[d] = s * dout[d];
          // d/dx of x * m / max(|x|, m): (m/|x|)(g - x (x.g) / |x|^2).
          const float* x = cfg.is_table(p)
                               ? params[p].rows + u * dim
                               : ctx->input(p).flat<float>().data() + ft.ids[j] * dim;
          float norm = 0;
          if (ClipScale(x, dim, max_norm, &norm) < 1.0f) {
            float xg = 0;
            for (int64_t d = 0; d < dim; ++d) xg += x[d] * g[d];
            const float k = xg / (norm * norm);
            const float rr = max_norm / norm;
            for (int64_t d = 0; d < dim; ++d) g[d] = rr * (g[d] - x[d] * k);
          }
          for (int64_t d = 0; d < dim; ++d) acc[d] += g[d];
        }
      }
    }
  }

  GroupConfig cfg_;
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookupGrad").Device(tf::DEVICE_CPU), GroupLookupGradOp);

}  // namespace
}  // namespace kre
