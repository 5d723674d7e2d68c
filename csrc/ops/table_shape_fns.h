// Copyright keras_rec_emb authors. Apache-2.0.
// What the table's op registrations share (table_ops.cc, delta_ops.cc): the
// start of the registration of an op on one table, the shape functions of
// ops that take a table handle, and the outputs of an export, declared once.
#ifndef KRE_OPS_TABLE_SHAPE_FNS_H_
#define KRE_OPS_TABLE_SHAPE_FNS_H_

#include <cstdint>

#include "tensorflow/core/framework/shape_inference.h"

namespace kre {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Input 0 is a table handle (a scalar resource).
inline absl::Status ScalarHandle(InferenceContext* c) {
  ShapeHandle unused;
  return c->WithRank(c->input(0), 0, &unused);
}

// Input 0 is a table handle and inputs 1 .. n-1 are scalars.
inline absl::Status HandleAndScalars(InferenceContext* c, int n) {
  TF_RETURN_IF_ERROR(ScalarHandle(c));
  ShapeHandle unused;
  for (int i = 1; i < n; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  return absl::OkStatus();
}

// The shape function of an op whose inputs are a table handle and n - 1
// scalars, and whose one output is a scalar.
template <int n>
absl::Status ScalarOfHandle(InferenceContext* c) {
  TF_RETURN_IF_ERROR(HandleAndScalars(c, n));
  c->set_output(0, c->Scalar());
  return absl::OkStatus();
}

// The shape function of an op whose input is a table handle and whose one
// output is a vector of `length` (counters, statistics).
template <int length>
absl::Status VectorOfHandle(InferenceContext* c) {
  TF_RETURN_IF_ERROR(ScalarHandle(c));
  c->set_output(0, c->Vector(length));
  return absl::OkStatus();
}

inline absl::Status GetDim(InferenceContext* c, int64_t* dim) { return c->GetAttr("dim", dim); }

// Input 0 is a table handle; *dim is the op's `dim` attribute.
inline absl::Status HandleAndDim(InferenceContext* c, int64_t* dim) {
  TF_RETURN_IF_ERROR(ScalarHandle(c));
  return GetDim(c, dim);
}

// REGISTER_OP of an op on one table: input 0 is the table's `handle`, attr
// `Tkeys` its key dtype, and the op is stateful. The chain goes on with the
// op's own inputs, outputs, attributes and shape function.
#define KRE_REGISTER_TABLE_OP(name) \
  REGISTER_OP(name).Input("handle: resource").Attr("Tkeys: {int32, int64}").SetIsStateful()

// The outputs of a table export, in kv::Table::ExportBuffers' order with the
// slot layout, the EV-initializer matrix and the Bloom counters: keys [N],
// values [N, dim], freqs [N], versions [N], slot_values [N, sum(widths)],
// slot_names, slot_widths, default_values [default_value_dim, dim], the keys
// counted but not admitted with their freqs and versions [NF], bloom bytes.
// Used inside a REGISTER_OP chain.
#define KRE_TABLE_EXPORT_OUTPUTS          \
  Output("keys: Tkeys")                   \
      .Output("values: float")            \
      .Output("freqs: int64")             \
      .Output("versions: int64")          \
      .Output("slot_values: float")       \
      .Output("slot_names: string")       \
      .Output("slot_widths: int64")       \
      .Output("default_values: float")    \
      .Output("keys_filtered: Tkeys")     \
      .Output("freqs_filtered: int64")    \
      .Output("versions_filtered: int64") \
      .Output("bloom: uint8")

// The shape function of an export: input 0 a table handle, inputs
// 1 .. n-1 scalars; sets the shapes of the KRE_TABLE_EXPORT_OUTPUTS
// (outputs 0 .. 11) for rows of the op's `dim`.
template <int n_inputs>
absl::Status ExportOfHandle(InferenceContext* c) {
  TF_RETURN_IF_ERROR(HandleAndScalars(c, n_inputs));
  int64_t dim;
  TF_RETURN_IF_ERROR(GetDim(c, &dim));
  DimensionHandle n = c->UnknownDim();
  c->set_output(0, c->Vector(n));
  c->set_output(1, c->Matrix(n, dim));
  c->set_output(2, c->Vector(n));
  c->set_output(3, c->Vector(n));
  c->set_output(4, c->Matrix(n, c->UnknownDim()));
  c->set_output(5, c->Vector(c->UnknownDim()));
  c->set_output(6, c->Vector(c->UnknownDim()));
  c->set_output(7, c->Matrix(c->UnknownDim(), dim));
  DimensionHandle nf = c->UnknownDim();
  for (int i = 8; i < 11; ++i) c->set_output(i, c->Vector(nf));
  c->set_output(11, c->Vector(c->UnknownDim()));
  return absl::OkStatus();
}

}  // namespace kre

#endif  // KRE_OPS_TABLE_SHAPE_FNS_H_
