// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of the table's statistics ops: KRE>TableStats and
// KRE>TableStorageStats (csrc/ops/table_ops.cc), KRE>TableCounters
// (csrc/ops/delta_ops.cc). Each returns an int64 vector whose parts
// csrc/ops/stat_parts.h names; the op receives those names back as its
// `parts` attr and the kernel checks them when it is built.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/table_resource.h"
#include "ops/stat_parts.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kre {
namespace {

inline int64_t I(uint64_t v) { return static_cast<int64_t>(v); }

// One entry per part of kTableStatsParts, in its order.
template <typename K>
std::array<int64_t, kTableStatsParts.size()> TableStatsValues(const kv::Table<K>& t) {
  return {t.Size(), t.FilteredSize(), I(t.MemoryBytes()), t.LatestStep()};
}

// One entry per part of kStorageStatsParts, in its order.
template <typename K>
std::array<int64_t, kStorageStatsParts.size()> StorageStatsValues(const kv::Table<K>& t) {
  const kv::RowStoreStats s = t.StoreStats();
  return {I(s.rows), I(s.cached_rows), I(s.memory_bytes), I(s.disk_bytes),
          I(s.hits), I(s.misses),      I(s.file_reads),   I(s.file_writes)};
}

// One entry per part of kCounterParts, in its order (it begins with
// kTableStatsParts: stat_parts.h asserts it).
template <typename K>
std::array<int64_t, kCounterParts.size()> CounterValues(const kv::Table<K>& t) {
  const std::array<int64_t, kTableStatsParts.size()> s = TableStatsValues(t);
  const kv::TableCounters c = t.Counters();
  return {s[0],
          s[1],
          s[2],
          s[3],
          I(c.lookups),
          I(c.hits),
          I(c.admitted),
          I(c.erased),
          t.ChangeEpoch(),
          t.ErasedLogSize()};
}

template <typename Names>
std::string Joined(const Names& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + std::string(names[i]);
  return out + "]";
}

// The kernel of an op whose output is the vector Values(table), named by
// `Parts`: its `parts` attr must name the same parts in the same order.
template <typename K, std::size_t N, const std::array<const char*, N>& Parts,
          std::array<int64_t, N> (*Values)(const kv::Table<K>&)>
class NamedStatsKernel : public TableOpKernel<K> {
 public:
  explicit NamedStatsKernel(OpKernelConstruction* ctx) : TableOpKernel<K>(ctx) {
    std::vector<std::string> given;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &given));
    OP_REQUIRES(ctx, given == std::vector<std::string>(Parts.begin(), Parts.end()),
                errors::InvalidArgument(
                    ctx->def().op(), " returns the parts ", Joined(Parts),
                    " in this order, but was given parts=", Joined(given),
                    ": keras_rec_emb/_ops.py and the compiled library disagree (rebuild "
                    "the library against this package: make build)"));
  }

 protected:
  void ComputeOnTable(OpKernelContext* ctx, kv::Table<K>& table) override {
    const std::array<int64_t, N> values = Values(table);
    OP_REQUIRES_OK(ctx,
                   SetVectorOutput(ctx, 0, std::vector<int64_t>(values.begin(), values.end())));
  }
};

template <typename K>
using TableStatsOp =
    NamedStatsKernel<K, kTableStatsParts.size(), kTableStatsParts, TableStatsValues<K>>;
template <typename K>
using TableStorageStatsOp =
    NamedStatsKernel<K, kStorageStatsParts.size(), kStorageStatsParts, StorageStatsValues<K>>;
template <typename K>
using TableCountersOp = NamedStatsKernel<K, kCounterParts.size(), kCounterParts, CounterValues<K>>;

KRE_REGISTER_TABLE_KERNEL("KRE>TableStats", TableStatsOp);
KRE_REGISTER_TABLE_KERNEL("KRE>TableStorageStats", TableStorageStatsOp);
KRE_REGISTER_TABLE_KERNEL("KRE>TableCounters", TableCountersOp);

}  // namespace
}  // namespace kre
