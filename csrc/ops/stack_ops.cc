// Copyright keras_rec_emb authors. Apache-2.0.
// Op registration and shape functions of the ops on the ids of F dense
// features stacked in one [batch, F, L] tensor: KRE>UnstackFeatureIds and
// KRE>UnstackKeptIds split them into what the fused group lookup takes per
// feature (flat int64 ids and row splits) in one op, instead of F strided
// slices (kernels: csrc/kernels/stack_kernels.cc); KRE>StackedPooledLookup
// looks them up and combines them where they are, for inference (kernel:
// csrc/kernels/stacked_lookup_kernels.cc).
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// The ops' input `input`: ids [batch, num_features, L]; sets *num_features.
absl::Status StackedIds(InferenceContext* c, int input, ShapeHandle* ids, int* num_features) {
  TF_RETURN_IF_ERROR(c->WithRank(c->input(input), 3, ids));
  TF_RETURN_IF_ERROR(c->GetAttr("num_features", num_features));
  DimensionHandle f;
  return c->WithValue(c->Dim(*ids, 1), *num_features, &f);
}

absl::Status UnstackFeatureIdsShape(InferenceContext* c) {
  ShapeHandle ids;
  int num_features;
  TF_RETURN_IF_ERROR(StackedIds(c, 0, &ids, &num_features));
  DimensionHandle batch = c->Dim(ids, 0);
  DimensionHandle n;
  TF_RETURN_IF_ERROR(c->Multiply(batch, c->Dim(ids, 2), &n));
  for (int j = 0; j < num_features; ++j) c->set_output(j, c->Vector(n));
  DimensionHandle splits;
  TF_RETURN_IF_ERROR(c->Add(batch, 1, &splits));
  c->set_output(num_features, c->Vector(splits));
  return absl::OkStatus();
}

absl::Status UnstackKeptIdsShape(InferenceContext* c) {
  ShapeHandle ids;
  int num_features;
  TF_RETURN_IF_ERROR(StackedIds(c, 0, &ids, &num_features));
  DimensionHandle splits;
  TF_RETURN_IF_ERROR(c->Add(c->Dim(ids, 0), 1, &splits));
  for (int j = 0; j < num_features; ++j) {
    c->set_output(j, c->Vector(c->UnknownDim()));  // as many as are kept
    c->set_output(num_features + j, c->Vector(splits));
  }
  return absl::OkStatus();
}

absl::Status StackedPooledLookupShape(InferenceContext* c) {
  int num_tables;
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
  ShapeHandle ids;
  int num_features;
  TF_RETURN_IF_ERROR(StackedIds(c, num_tables, &ids, &num_features));
  std::vector<int64_t> dims, feature_tables;
  TF_RETURN_IF_ERROR(c->GetAttr("table_dims", &dims));
  TF_RETURN_IF_ERROR(c->GetAttr("feature_tables", &feature_tables));
  if (static_cast<int>(dims.size()) != num_tables ||
      static_cast<int>(feature_tables.size()) != num_features) {
    return absl::InvalidArgumentError(
        "table_dims must have num_tables entries and feature_tables num_features");
  }
  int64_t width = 0;
  for (int64_t t : feature_tables) {
    if (t < 0 || t >= num_tables) {
      return absl::InvalidArgumentError("feature_tables entries must be in [0, num_tables)");
    }
    width += dims[t];
  }
  c->set_output(0, c->MakeShape({c->Dim(ids, 0), c->MakeDim(width)}));
  return absl::OkStatus();
}

}  // namespace

// ids [batch, F, L] -> for j < F, values_j = the ids >= 0 of ids[:, j, :]
// row by row (int64; ids < 0 are padding, dropped) and row_splits_j their
// row splits [batch + 1]. What KRE>UnstackFeatureIds gives, with the
// padding already pruned, as the group lookup would prune it: the lookup
// then reads each feature's ids as they are.
REGISTER_OP("KRE>UnstackKeptIds")
    .Input("ids: T")
    .Output("values: num_features * int64")
    .Output("row_splits: num_features * int64")
    .Attr("T: {int32, int64}")
    .Attr("num_features: int >= 1")
    .SetShapeFn(UnstackKeptIdsShape);

// ids [batch, F, L] -> values_j = ids[:, j, :] flattened row by row (int64,
// ids < 0 kept: they are padding the group lookup prunes) for j < F, and
// row_splits = [0, L, 2L, ..., batch * L], shared by every feature.
REGISTER_OP("KRE>UnstackFeatureIds")
    .Input("ids: T")
    .Output("values: num_features * int64")
    .Output("row_splits: int64")
    .Attr("T: {int32, int64}")
    .Attr("num_features: int >= 1")
    .SetShapeFn(UnstackFeatureIdsShape);

// The inference lookup of stacked ids [batch, F, L] (int32 or int64): row b
// of feature j's ids is ids[b, j, :], ids < 0 are padding (dropped), a row
// left empty reads id default_ids[j] when it is >= 0 (else gives zeros), and
// the rows are combined by combiners[j] ("sum", "mean": / n, "sqrtn":
// / sqrt(n)) into output[b, columns of j], features side by side in order
// ([batch, sum of their tables' dims]). Feature j reads table
// feature_tables[j] (key dtype table_key_dtypes[t], dim table_dims[t]);
// tables may serve several features. Missing keys read their default row
// and nothing is inserted. The same outputs as KRE>GroupLookup with concat
// over KRE>UnstackKeptIds' split of the same ids, in one op: the split, then
// each feature's blocks of ids looked up and combined into the output.
REGISTER_OP("KRE>StackedPooledLookup")
    .Input("tables: num_tables * resource")
    .Input("ids: T")
    .Output("output: float")
    .Attr("T: {int32, int64}")
    .Attr("num_tables: int >= 1")
    .Attr("num_features: int >= 1")
    .Attr("table_key_dtypes: list({int32, int64}) >= 1")
    .Attr("table_dims: list(int)")
    .Attr("feature_tables: list(int)")
    .Attr("combiners: list(string)")
    .Attr("default_ids: list(int)")
    .SetIsStateful()
    .SetShapeFn(StackedPooledLookupShape);

}  // namespace kre
