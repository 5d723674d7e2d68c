// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of the table's change tracking (see csrc/ops/delta_ops.cc; its
// counters: stats_kernels.cc).
#include <string>
#include <vector>

#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

template <typename K>
void TableMarkChanges(OpKernelContext* ctx, kv::Table<K>& table) {
  OP_REQUIRES_OK(ctx, SetScalarOutput<int64_t>(ctx, 0, table.MarkChanges()));
}

template <typename K>
void TableExportChangedSince(OpKernelContext* ctx, kv::Table<K>& table) {
  int64_t since;
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "since", &since));
  absl::Status status;
  std::vector<K> erased;
  const bool complete = table.ExportChangedSince(
      since,
      [&](int64_t n, int64_t nf) { return AllocateExportOutputs(ctx, table, n, nf, &status); },
      &erased);
  OP_REQUIRES_OK(ctx, status);
  OP_REQUIRES_OK(ctx, SetBloomOutput(ctx, 11, table));
  OP_REQUIRES_OK(ctx, SetVectorOutput(ctx, 12, erased));
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 13, complete));
}

template <typename K>
void TableTrimErased(OpKernelContext* ctx, kv::Table<K>& table) {
  int64_t upto;
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "upto", &upto));
  table.TrimErasedLog(upto);
  OP_REQUIRES_OK(ctx, SetScalarOutput<int64_t>(ctx, 0, table.ErasedLogSize()));
}

template <typename K>
void TableErase(OpKernelContext* ctx, kv::Table<K>& table) {
  const Tensor& keys = ctx->input(1);
  OP_REQUIRES_OK(ctx, validate::Vector(keys, "keys"));
  int64_t erased = 0;
  const K* k = keys.flat<K>().data();
  for (int64_t i = 0; i < keys.NumElements(); ++i) erased += table.Erase(k[i]);
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 0, erased));
}

KRE_REGISTER_TABLE_FN("KRE>TableMarkChanges", TableMarkChanges);
KRE_REGISTER_TABLE_FN("KRE>TableExportChangedSince", TableExportChangedSince);
KRE_REGISTER_TABLE_FN("KRE>TableTrimErased", TableTrimErased);
KRE_REGISTER_TABLE_FN("KRE>TableErase", TableErase);

}  // namespace
}  // namespace kre
