// Copyright keras_rec_emb authors. Apache-2.0.
// What the TensorFlow pooled lookup kernels share (the group lookup:
// group_config.cc, group_forward.cc, group_backward.cc; the stacked pooled
// lookup: stacked_lookup_kernels.cc): a table of either key dtype resolved
// from its handle. The combiners (and ParseCombiner, by name) and
// CombinePooledRows, the pooled path's combine, are TensorFlow-free, in
// core/pooled_rows.h (the JAX binding runs them too).
#ifndef KRE_KERNELS_POOLED_COMBINE_H_
#define KRE_KERNELS_POOLED_COMBINE_H_

#include <cstdint>

#include "core/pooled_rows.h"
#include "kernels/table_resource.h"

namespace kre {

// A table of either key dtype.
struct TableSlot {
  tf::core::RefCountPtr<TableResource<int64_t>> t64;
  tf::core::RefCountPtr<TableResource<int32_t>> t32;
  int num_shards() const { return t64 ? t64->table().num_shards() : t32->table().num_shards(); }
  bool filtered() const {
    return t64 ? t64->table().filtering() || t64->table().bloom()
               : t32->table().filtering() || t32->table().bloom();
  }
  const float* NoPermissionRow() const {
    return t64 ? t64->table().NoPermissionRow() : t32->table().NoPermissionRow();
  }
  uint64_t Hash(int64_t id) const {
    return t64 ? kv::Table<int64_t>::Hash(id) : kv::Table<int32_t>::Hash(static_cast<int32_t>(id));
  }
  bool PrefersOrderedLookup(int64_t n) const {
    return t64 ? t64->table().PrefersOrderedLookup(n) : t32->table().PrefersOrderedLookup(n);
  }
};

// Resolves input `input` of ctx, the handle of table `t` (for messages),
// into *slot, checking its key dtype and dim against what the op was told.
inline absl::Status ResolveTable(OpKernelContext* ctx, int input, int t, tf::DataType key_dtype,
                                 int64_t dim, TableSlot* slot) {
  tf::core::RefCountPtr<TableResourceBase> base;
  TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, input), &base));
  if (base->key_dtype() != key_dtype) {
    return errors::InvalidArgument("table ", t, " has key dtype ",
                                   tf::DataTypeString(base->key_dtype()), " but the op was told ",
                                   tf::DataTypeString(key_dtype));
  }
  if (base->dim() != dim) {
    return errors::InvalidArgument("table ", t, " has dim ", base->dim(),
                                   " but the op expects dim ", dim);
  }
  if (key_dtype == tf::DT_INT64) {
    auto* typed = dynamic_cast<TableResource<int64_t>*>(base.get());
    if (typed == nullptr) return errors::Internal("table ", t, " is not int64-keyed");
    typed->Ref();
    slot->t64.reset(typed);
  } else {
    auto* typed = dynamic_cast<TableResource<int32_t>*>(base.get());
    if (typed == nullptr) return errors::Internal("table ", t, " is not int32-keyed");
    typed->Ref();
    slot->t32.reset(typed);
  }
  return absl::OkStatus();
}

}  // namespace kre

#endif  // KRE_KERNELS_POOLED_COMBINE_H_
