// Copyright keras_rec_emb authors. Apache-2.0.
// Op registration and shape functions of KRE>UnstackFeatureIds and
// KRE>UnstackKeptIds: the ids of F dense features stacked in one
// [batch, F, L] tensor, split into what the fused group lookup takes per
// feature (flat int64 ids and row splits) in one op, instead of F strided
// slices. Kernels: csrc/kernels/stack_kernels.cc.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Both ops' input: ids [batch, num_features, L]; sets *num_features.
absl::Status StackedIds(InferenceContext* c, ShapeHandle* ids, int* num_features) {
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, ids));
  TF_RETURN_IF_ERROR(c->GetAttr("num_features", num_features));
  DimensionHandle f;
  return c->WithValue(c->Dim(*ids, 1), *num_features, &f);
}

absl::Status UnstackFeatureIdsShape(InferenceContext* c) {
  ShapeHandle ids;
  int num_features;
  TF_RETURN_IF_ERROR(StackedIds(c, &ids, &num_features));
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
  TF_RETURN_IF_ERROR(StackedIds(c, &ids, &num_features));
  DimensionHandle splits;
  TF_RETURN_IF_ERROR(c->Add(c->Dim(ids, 0), 1, &splits));
  for (int j = 0; j < num_features; ++j) {
    c->set_output(j, c->Vector(c->UnknownDim()));  // as many as are kept
    c->set_output(num_features + j, c->Vector(splits));
  }
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

}  // namespace kre
