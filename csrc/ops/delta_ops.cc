// Copyright keras_rec_emb authors. Apache-2.0.
// Op registrations of the table's change tracking (incremental checkpoints,
// serving deltas) and counters (statistics). Kernels:
// csrc/kernels/delta_kernels.cc, the counters' csrc/kernels/stats_kernels.cc.
#include "ops/stat_parts.h"
#include "ops/table_shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {

// Closes the table's current change epoch and returns it as a mark: changes
// from now on are "after" it. Turns on the log of erased keys.
KRE_REGISTER_TABLE_OP("KRE>TableMarkChanges").Output("mark: int64").SetShapeFn(ScalarOfHandle<1>);

// Exports, like KRE>TableExport, only the keys changed after mark `since`,
// plus `erased` (keys erased after it) and `complete` (false when the
// contents were replaced wholesale after `since`: take a full export).
// default_values and bloom are always whole.
KRE_REGISTER_TABLE_OP("KRE>TableExportChangedSince")
    .Input("since: int64")
    .KRE_TABLE_EXPORT_OUTPUTS.Output("erased: Tkeys")
    .Output("complete: bool")
    .Attr("dim: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ExportOfHandle<2>(c));
      c->set_output(12, c->Vector(c->UnknownDim()));
      c->set_output(13, c->Scalar());
      return absl::OkStatus();
    });

// Forgets logged erasures at or before mark `upto`; returns the log's size.
KRE_REGISTER_TABLE_OP("KRE>TableTrimErased")
    .Input("upto: int64")
    .Output("remaining: int64")
    .SetShapeFn(ScalarOfHandle<2>);

// Erases `keys` (a vector; absent keys are skipped); returns how many were
// present.
KRE_REGISTER_TABLE_OP("KRE>TableErase")
    .Input("keys: Tkeys")
    .Output("erased: int64")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c));
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

// The table's counters: a vector of the parts kCounterParts names
// (ops/stat_parts.h; checked as KRE>TableStats' are).
KRE_REGISTER_TABLE_OP("KRE>TableCounters")
    .Output("counters: int64")
    .Attr(PartsAttr(kCounterParts))
    .SetShapeFn(VectorOfHandle<kCounterParts.size()>);

}  // namespace kre
