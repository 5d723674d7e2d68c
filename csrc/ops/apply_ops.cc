// Copyright keras_rec_emb authors. Apache-2.0.
// Optimizer ops beside KRE>TableSparseApply (csrc/ops/table_ops.cc).
#include "ops/table_shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {

// KRE>TableSparseApply for `keys` that are distinct (the caller promises it:
// the table gradient of KRE>GroupLookup, or the output of a unique): the same
// update, version stamps, insertions and filtering, without the dedupe and
// the copy of the gradient rows, with the rows prefetched ahead. Equal keys
// would be applied once each, in order, instead of once with their sum.
KRE_REGISTER_TABLE_OP("KRE>TableSparseApplyDistinct")
    .Input("keys: Tkeys")
    .Input("grads: float")
    .Input("hyper: float")
    .Input("step: int64")
    .Attr("rule: {'sgd', 'momentum', 'adagrad', 'adam', 'ftrl', 'adam_async', "
          "'adagrad_decay', 'ftrl_group'}")
    .Attr("slots: list(string) >= 0")
    .Attr("hparam_names: list(string) >= 2")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c));
      ShapeHandle keys, grads, hyper, step;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &grads));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &hyper));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &step));
      DimensionHandle unused;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(keys, 0), c->Dim(grads, 0), &unused));
      return absl::OkStatus();
    });

}  // namespace kre
