// Copyright keras_rec_emb authors. Apache-2.0.
// Op registration of KRE>ArrowBatchToTensors (kernel:
// csrc/kernels/arrow_kernels.cc): one Arrow record batch, handed over
// through the Arrow C data interface, to the tensors of its columns.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {

// `batch` holds two addresses: an ArrowArray (a struct array, one child per
// column) and its ArrowSchema, both exported by the caller (e.g. pyarrow's
// RecordBatch._export_to_c). The op takes ownership of the array (moving it
// out of the caller's struct, which it marks released; the tensors it
// returns share the Arrow buffers and release them when the last is
// destroyed) and releases the schema.
//
// Column c is read with ragged_ranks[c] variable-length list levels, then
// inner_ranks[c] fixed-size levels (sizes in inner_shapes, concatenated over
// the columns). Its components, in order: the values [n, *inner_shape]
// (dtype out_types[...]; strings as tf.string), then one int64 row_splits
// vector per ragged level, outermost first. Nulls are not accepted (the
// caller fills them). Buffers that are suitably aligned are shared, others
// copied.
REGISTER_OP("KRE>ArrowBatchToTensors")
    .Input("batch: int64")
    .Output("components: out_types")
    .Attr("out_types: list(type) >= 1")
    .Attr("ragged_ranks: list(int) >= 1")
    .Attr("inner_ranks: list(int) >= 1")
    .Attr("inner_shapes: list(int) >= 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnknownShape);

}  // namespace kre
