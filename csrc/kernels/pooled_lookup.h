// Copyright keras_rec_emb authors. Apache-2.0.
// The pooled path of the TensorFlow lookup kernels: PooledRowsOf
// (pooled_rows.h, the kernel without TensorFlow) with its errors as a
// Status, on a table of either key dtype, and the split of a feature over
// threads. Serves the group lookup's pooled features (group_forward.cc) and
// every feature of the stacked pooled lookup (stacked_lookup_kernels.cc).
#ifndef KRE_KERNELS_POOLED_LOOKUP_H_
#define KRE_KERNELS_POOLED_LOOKUP_H_

#include <algorithm>
#include <cstdint>

#include "core/pooled_rows.h"
#include "kernels/pooled_combine.h"
#include "kernels/table_resource.h"

namespace kre {

// Rows per unit of work at least, when a feature is split over threads.
constexpr int64_t kPooledMinUnitRows = 256;

// How many units a pooled feature of `rows` rows is split into, with F
// features in all on `threads` threads: two units a thread in all, none
// under kPooledMinUnitRows rows.
inline int64_t PooledRanges(int threads, int64_t features, int64_t rows) {
  return std::max<int64_t>(
      1, std::min<int64_t>((2 * threads + features - 1) / std::max<int64_t>(features, 1),
                           rows / kPooledMinUnitRows));
}

// PooledRowsOf, an id that does not fit an int32 table's keys as
// InvalidArgument.
template <typename K>
absl::Status PooledRows(kv::Table<K>& table, const PooledFeature& pf, int64_t begin, int64_t end,
                        float* buffer) {
  const PooledBadId bad = PooledRowsOf(table, pf, begin, end, buffer);
  if (!bad.ok) {
    return errors::InvalidArgument("id ", bad.id, " of feature ", pf.feature, " (row ", bad.row,
                                   ") does not fit table ", pf.table, "'s int32 keys");
  }
  return absl::OkStatus();
}

// PooledRows on a table of either key dtype.
inline absl::Status PooledRows(const TableSlot& table, const PooledFeature& pf, int64_t begin,
                               int64_t end, float* buffer) {
  return table.t64 ? PooledRows(table.t64->table(), pf, begin, end, buffer)
                   : PooledRows(table.t32->table(), pf, begin, end, buffer);
}

}  // namespace kre

#endif  // KRE_KERNELS_POOLED_LOOKUP_H_
