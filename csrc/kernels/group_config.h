// Copyright keras_rec_emb authors. Apache-2.0.
// Configuration and input validation of the fused group lookup
// (csrc/ops/group_ops.cc): the op's attributes, read and checked once at
// kernel construction (GroupConfig), and each feature's ids, row splits and
// weights, checked and pruned per call (BuildFeature). Shared by the forward
// (group_forward.cc) and the backward (group_backward.cc).
#ifndef KRE_KERNELS_GROUP_CONFIG_H_
#define KRE_KERNELS_GROUP_CONFIG_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/pooled_combine.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kre {

// How one feature is read and combined (the op's per-feature attributes).
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

  int num_params() const { return num_tables + num_dense; }
  bool is_table(int p) const { return p < num_tables; }

  absl::Status Init(OpKernelConstruction* ctx);

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
  // Whether its weights came from a weights input (else every kept id,
  // default ids included, weighs 1).
  bool weighted = false;
  // ids[j] is distinct id inverse[j] of its parameter (an output of the
  // forward, an input of the backward).
  int32_t* inverse = nullptr;
  // A feature built in place (BuildFeature's `in_place`): its num_raw kept
  // ids in `raw` (not zeroed first), or, when its ids input needed no
  // pruning or filling, that input itself (`given`); no weights; `ids` and
  // `weights` stay empty.
  std::shared_ptr<int64_t[]> raw;  // (Features are copied by assign)
  const int64_t* given = nullptr;
  int64_t num_raw = 0;
  bool in_place() const { return raw || given; }
  int64_t kept() const { return in_place() ? num_raw : static_cast<int64_t>(ids.size()); }
  // The kept ids, built in place or not.
  const int64_t* kept_ids() const {
    return given != nullptr ? given : raw ? raw.get() : ids.data();
  }
};

// Checks feature f's ids, row_splits and weights inputs and writes its kept
// ids (ids < 0 dropped with `prune`; with explicit weights, a mean or sqrtn
// feature drops ids of weight <= 0; an empty row filled with default_id)
// and their weights into *out. With `in_place` (a feature read by the
// pooled path: a table's, no weights input) only the kept ids are written
// (Feature::raw), or none when the ids input is already what they would be
// and the table's keys are int64 (Feature::given).
absl::Status BuildFeature(OpKernelContext* ctx, const GroupConfig& cfg, int f, Feature* out,
                          bool in_place = false);

// The cost of one BuildFeature call, in cycles, for the intra-op pool's
// split: the features' ids inputs average size times a cost per id.
int64_t BuildFeatureCost(OpKernelContext* ctx, const GroupConfig& cfg);

// Whether feature f's deduplicated lookup and its backward read no more of
// it than its kept ids and row splits (a table's pooled feature without
// max_norm, all its ids weighing 1 unless a weights input says otherwise):
// then BuildFeature may build it in place.
inline bool KeptIdsSuffice(const GroupConfig& cfg, int f) {
  const FeatureAttrs& a = cfg.feature[f];
  return cfg.is_table(a.param) && !a.sequence && a.max_norm <= 0;
}

// BuildFeature for every feature, over the intra-op pool (in place where
// KeptIdsSuffice).
absl::Status BuildFeatures(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<Feature>* features);

// Resolves the tables (inputs 0..num_tables), checking their key dtypes and
// dims against the attributes.
absl::Status ResolveTables(OpKernelContext* ctx, const GroupConfig& cfg,
                           std::vector<TableSlot>* tables);

// Checks the dense parameters' shapes ([vocab, dim]).
absl::Status CheckDense(OpKernelContext* ctx, const GroupConfig& cfg);

}  // namespace kre

#endif  // KRE_KERNELS_GROUP_CONFIG_H_
