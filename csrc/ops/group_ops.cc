// Copyright keras_rec_emb authors. Apache-2.0.
// Op registrations and shape functions of the fused group lookup: many
// features over many parameters (embedding tables and dense [vocab, dim]
// matrices) in one forward op and one backward op. Kernels live in
// csrc/kernels/group_config.cc (attributes and inputs), group_forward.cc
// and group_backward.cc.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

struct GroupAttrs {
  int num_tables = 0;
  int num_dense = 0;
  int num_features = 0;
  std::vector<int64_t> param_dims;
  std::vector<int64_t> feature_params;
  std::vector<bool> is_sequence;
  bool concat = false;
};

absl::Status ReadGroupAttrs(InferenceContext* c, GroupAttrs* a) {
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &a->num_tables));
  TF_RETURN_IF_ERROR(c->GetAttr("num_dense", &a->num_dense));
  TF_RETURN_IF_ERROR(c->GetAttr("num_features", &a->num_features));
  TF_RETURN_IF_ERROR(c->GetAttr("param_dims", &a->param_dims));
  TF_RETURN_IF_ERROR(c->GetAttr("feature_params", &a->feature_params));
  TF_RETURN_IF_ERROR(c->GetAttr("is_sequence", &a->is_sequence));
  TF_RETURN_IF_ERROR(c->GetAttr("concat", &a->concat));
  const int64_t num_params = a->num_tables + a->num_dense;
  int given_params;
  TF_RETURN_IF_ERROR(c->GetAttr("num_params", &given_params));
  if (given_params != num_params) {
    return absl::InvalidArgumentError("num_params must be num_tables + num_dense");
  }
  if (static_cast<int64_t>(a->param_dims.size()) != num_params) {
    return absl::InvalidArgumentError("param_dims must have num_tables + num_dense entries");
  }
  if (static_cast<int64_t>(a->feature_params.size()) != a->num_features ||
      static_cast<int64_t>(a->is_sequence.size()) != a->num_features) {
    return absl::InvalidArgumentError(
        "feature_params and is_sequence must have num_features entries");
  }
  for (int64_t p : a->feature_params) {
    if (p < 0 || p >= num_params) {
      return absl::InvalidArgumentError("feature_params entry out of range");
    }
  }
  for (int64_t d : a->param_dims) {
    if (d < 1) return absl::InvalidArgumentError("param_dims must be >= 1");
  }
  for (bool seq : a->is_sequence) {
    if (seq && a->concat) {
      return absl::InvalidArgumentError("concat = true needs every is_sequence entry false");
    }
  }
  return absl::OkStatus();
}

// Checks ranks of the shared inputs: tables (scalar handles), dense params
// [vocab, dim], and per feature ids [nnz], row_splits [B + 1], weights [nnz
// or 0]. Returns the batch size of each feature (unknown when not static).
absl::Status CheckGroupInputs(InferenceContext* c, const GroupAttrs& a,
                              std::vector<DimensionHandle>* batch) {
  ShapeHandle s;
  int i = 0;
  for (int t = 0; t < a.num_tables; ++t, ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &s));
  }
  for (int d = 0; d < a.num_dense; ++d, ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &s));
    DimensionHandle unused;
    TF_RETURN_IF_ERROR(c->WithValue(c->Dim(s, 1), a.param_dims[a.num_tables + d], &unused));
  }
  const int ids0 = i, splits0 = i + a.num_features, weights0 = i + 2 * a.num_features;
  batch->clear();
  for (int f = 0; f < a.num_features; ++f) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(ids0 + f), 1, &s));
    TF_RETURN_IF_ERROR(c->WithRank(c->input(weights0 + f), 1, &s));
    ShapeHandle splits;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(splits0 + f), 1, &splits));
    DimensionHandle b;
    TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &b));
    batch->push_back(b);
  }
  return absl::OkStatus();
}

}  // namespace

// The inputs and attributes both ops start with, in this order (macros:
// REGISTER_OP is one chain of calls).
#define KRE_GROUP_INPUTS                         \
  .Input("tables: num_tables * resource")        \
      .Input("dense_params: num_dense * float")  \
      .Input("ids: num_features * int64")        \
      .Input("row_splits: num_features * int64") \
      .Input("weights: num_features * float")
#define KRE_GROUP_ATTRS                                    \
  .Attr("num_tables: int >= 0")                            \
      .Attr("num_dense: int >= 0")                         \
      .Attr("num_features: int >= 1")                      \
      .Attr("num_params: int >= 1")                        \
      .Attr("table_key_dtypes: list({int32, int64}) >= 0") \
      .Attr("param_dims: list(int)")                       \
      .Attr("feature_params: list(int)")                   \
      .Attr("combiners: list(string)")                     \
      .Attr("max_norms: list(float)")                      \
      .Attr("default_ids: list(int)")                      \
      .Attr("prune_invalid_ids: list(bool)")               \
      .Attr("is_sequence: list(bool)")

// Looks up and combines many features in one op. Parameters are the
// `tables` (embedding-table handles; key dtypes in `table_key_dtypes`)
// followed by the `dense_params` ([vocab, dim] float matrices); feature f
// reads parameter feature_params[f], whose width is param_dims[p].
//
// Feature f is ragged: ids[f] [nnz] (int64; cast to an int32 table's key
// dtype), row_splits[f] [B + 1], weights[f] [nnz] or [0] for all-ones.
// Per feature: with prune_invalid_ids[f] ids < 0 are dropped (with their
// weights); a row left empty reads id default_ids[f] with weight 1 when
// default_ids[f] >= 0 (else it is zeros); with max_norms[f] > 0 each row is
// scaled to L2 norm at most max_norms[f]; then rows are combined by
// combiners[f] ("sum", "mean": / sum(w), "sqrtn": / sqrt(sum(w^2))) into
// outputs[f] [B, dim], or with is_sequence[f] laid out as [B, T, dim]
// (row * weight, T the longest row, zero padded). With `insert`, missing
// table keys are inserted and counted (training): each distinct key is
// looked up once, counted as often as it occurs.
//
// Also returns, per parameter p, the distinct ids it was read with,
// unique_ids[p] [U] (int64: table keys in the table's key dtype, or row
// indices of a dense param), and per feature inverse[f] [n] (int32): the
// index in unique_ids of each id kept after pruning and default filling.
//
// With `concat` (no sequence features, every feature of one batch size B)
// outputs[0] is [B, sum of the features' dims], the features' outputs side
// by side in feature order (what a concatenation of the outputs gives,
// written in place), and outputs[1:] are empty [0]; the gradient then takes
// output_grads[0] of that shape (output_grads[1:] are ignored).
//
// An inference lookup (without `insert`) reads a feature that is its
// table's only feature, without weights, max_norm or sequence output, in
// batch order without deduplication: unique_ids[p] then lists every kept id
// (repeats too) and inverse[f] counts 0, 1, ... (the kernel's pooled path;
// csrc/kernels/group_forward.cc states the rule). The outputs are the same.
REGISTER_OP("KRE>GroupLookup")
KRE_GROUP_INPUTS.Output("outputs: num_features * float")
    .Output("unique_ids: num_params * int64")
    .Output("inverse: num_features * int32") KRE_GROUP_ATTRS.Attr("insert: bool = false")
    .Attr("concat: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      GroupAttrs a;
      TF_RETURN_IF_ERROR(ReadGroupAttrs(c, &a));
      std::vector<DimensionHandle> batch;
      TF_RETURN_IF_ERROR(CheckGroupInputs(c, a, &batch));
      const int num_params = a.num_tables + a.num_dense;
      int64_t width = 0;
      for (int f = 0; f < a.num_features; ++f) width += a.param_dims[a.feature_params[f]];
      for (int f = 0; f < a.num_features; ++f) {
        const int64_t dim = a.param_dims[a.feature_params[f]];
        if (a.concat) {
          c->set_output(f, f == 0 ? c->MakeShape({batch[0], c->MakeDim(width)}) : c->Vector(0));
        } else if (a.is_sequence[f]) {
          c->set_output(f, c->MakeShape({batch[f], c->UnknownDim(), c->MakeDim(dim)}));
        } else {
          c->set_output(f, c->MakeShape({batch[f], c->MakeDim(dim)}));
        }
        c->set_output(a.num_features + num_params + f, c->Vector(c->UnknownDim()));
      }
      for (int p = 0; p < num_params; ++p) {
        c->set_output(a.num_features + p, c->Vector(c->UnknownDim()));
      }
      return absl::OkStatus();
    });

// The gradient of KRE>GroupLookup: same inputs and attributes plus the
// forward's unique_ids and inverse outputs and the gradients of its
// outputs. For each parameter p (tables, then dense params) returns the
// summed gradient of the rows of its distinct ids unique_ids[p],
// unique_grads[p] [U, param_dims[p]].
REGISTER_OP("KRE>GroupLookupGrad")
KRE_GROUP_INPUTS.Input("unique_ids: num_params * int64")
    .Input("inverse: num_features * int32")
    .Input("output_grads: num_features * float")
    .Output("unique_grads: num_params * float") KRE_GROUP_ATTRS.Attr("concat: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      GroupAttrs a;
      TF_RETURN_IF_ERROR(ReadGroupAttrs(c, &a));
      const int num_params = a.num_tables + a.num_dense;
      std::vector<DimensionHandle> batch;
      TF_RETURN_IF_ERROR(CheckGroupInputs(c, a, &batch));
      const int grads0 = 2 * (a.num_tables + a.num_dense) + 4 * a.num_features;
      for (int f = 0; f < a.num_features; ++f) {
        ShapeHandle g;
        if (a.concat && f > 0) continue;  // output_grads[0] holds them all
        TF_RETURN_IF_ERROR(c->WithRank(c->input(grads0 + f), a.is_sequence[f] ? 3 : 2, &g));
      }
      for (int p = 0; p < num_params; ++p) {
        c->set_output(p, c->MakeShape({c->UnknownDim(), c->MakeDim(a.param_dims[p])}));
      }
      return absl::OkStatus();
    });

}  // namespace kre
