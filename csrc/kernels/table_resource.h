// Copyright keras_rec_emb authors. Apache-2.0.
// The TensorFlow resource that owns a kv::Table, and helpers shared by the
// kernels: typed lookup of the resource, thread-pool sharding, and running
// per-shard table work with C++ exceptions turned into Status.
#ifndef KRE_KERNELS_TABLE_RESOURCE_H_
#define KRE_KERNELS_TABLE_RESOURCE_H_

#include <exception>
#include <mutex>
#include <string>

#include "kv/partition.h"
#include "kv/table.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace kre {

namespace tf = ::tensorflow;

// Untyped base so that a handle can be resolved first and its key dtype
// checked with a clear error (the resource manager keys types exactly).
class TableResourceBase : public tf::ResourceBase {
 public:
  virtual tf::DataType key_dtype() const = 0;
  virtual int64_t dim() const = 0;
};

template <typename K>
class TableResource : public TableResourceBase {
 public:
  explicit TableResource(kv::TableOptions options) : table_(std::move(options)) {}

  kv::Table<K>& table() { return table_; }
  tf::DataType key_dtype() const override { return tf::DataTypeToEnum<K>::v(); }
  int64_t dim() const override { return table_.dim(); }
  std::string DebugString() const override {
    return "KRE EmbeddingTable(key_dtype=" + tf::DataTypeString(key_dtype()) +
           ", dim=" + std::to_string(table_.dim()) +
           ", size=" + std::to_string(table_.Size()) + ")";
  }
  int64_t MemoryUsed() const override {
    return static_cast<int64_t>(table_.MemoryBytes());
  }

 private:
  kv::Table<K> table_;
};

// Resolves input 0 to a table with key type K and, when dim >= 0, rows of
// width dim (the op's static `dim` attribute).
template <typename K>
absl::Status GetTable(tf::OpKernelContext* ctx,
                      tf::core::RefCountPtr<TableResource<K>>* out, int64_t dim = -1) {
  tf::core::RefCountPtr<TableResourceBase> base;
  TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), &base));
  auto* typed = dynamic_cast<TableResource<K>*>(base.get());
  if (typed == nullptr) {
    return tf::errors::InvalidArgument(
        "the embedding table has key dtype ", tf::DataTypeString(base->key_dtype()),
        " but this op was given ", tf::DataTypeString(tf::DataTypeToEnum<K>::v()),
        " keys; cast the keys to the table's key dtype");
  }
  if (dim >= 0 && typed->dim() != dim) {
    return tf::errors::InvalidArgument("the embedding table has dim ", typed->dim(),
                                       " but the op expects dim ", dim);
  }
  typed->Ref();
  out->reset(typed);
  return absl::OkStatus();
}

// Runs fn(i) for i in [0, n) over the intra-op thread pool. Exceptions
// (allocation failure, a full shard) become a ResourceExhausted status.
template <typename Fn>
absl::Status ParallelFor(tf::OpKernelContext* ctx, int64_t n,
                         int64_t cost_per_unit, Fn&& fn) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  std::mutex mu;
  absl::Status status;
  tf::Shard(workers->num_threads, workers->workers, n, cost_per_unit,
            [&](int64_t begin, int64_t end) {
              try {
                for (int64_t i = begin; i < end; ++i) fn(i);
              } catch (const std::exception& e) {
                std::lock_guard<std::mutex> lock(mu);
                status = tf::errors::ResourceExhausted(
                    "embedding table operation failed: ", e.what());
              }
            });
  return status;
}

// Groups keys by shard using the thread pool.
template <typename K>
kv::Partitioned<K> PartitionKeys(tf::OpKernelContext* ctx, const kv::Table<K>& table,
                              const K* keys, int64_t n) {
  const int blocks = std::max(
      1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
  return kv::Partition(table, keys, n, blocks, [&](int num_blocks, auto&& fn) {
    // Each block hashes n / blocks keys (a few ns each).
    ParallelFor(ctx, num_blocks, 8 * (n / num_blocks + 1),
                [&](int64_t b) { fn(static_cast<int>(b)); })
        .IgnoreError();
  });
}

}  // namespace kre

#endif  // KRE_KERNELS_TABLE_RESOURCE_H_
