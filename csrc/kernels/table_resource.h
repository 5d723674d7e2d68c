// Copyright keras_rec_emb authors. Apache-2.0.
// The TensorFlow resource that owns a kv::Table, and helpers shared by the
// kernels: typed lookup of the resource (and TableOpKernel, the base of
// kernels on one table), scalar and export outputs, thread-pool sharding,
// and running per-shard table work with C++ exceptions turned into Status.
#ifndef KRE_KERNELS_TABLE_RESOURCE_H_
#define KRE_KERNELS_TABLE_RESOURCE_H_

#include <algorithm>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/checked.h"
#include "kv/partition.h"
#include "kv/table.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/types.h"

namespace kre {

namespace tf = ::tensorflow;
// The names the kernels use unqualified.
using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;
namespace errors = tf::errors;

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
           ", dim=" + std::to_string(table_.dim()) + ", size=" + std::to_string(table_.Size()) +
           ")";
  }
  int64_t MemoryUsed() const override { return static_cast<int64_t>(table_.MemoryBytes()); }

 private:
  kv::Table<K> table_;
};

// Resolves input 0 to a table with key type K and, when dim >= 0, rows of
// width dim (the op's static `dim` attribute).
template <typename K>
absl::Status GetTable(tf::OpKernelContext* ctx, tf::core::RefCountPtr<TableResource<K>>* out,
                      int64_t dim = -1) {
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

// The status of table work that threw: DataLoss when a file-tier table's
// files no longer hold its rows (kv::DataLossError), else ResourceExhausted
// (allocation failure, a full shard or disk, an I/O error).
inline absl::Status TableWorkError(const std::exception& e) {
  if (dynamic_cast<const kv::DataLossError*>(&e) != nullptr) {
    return tf::errors::DataLoss("embedding table operation failed: ", e.what());
  }
  return tf::errors::ResourceExhausted("embedding table operation failed: ", e.what());
}

// Base of the kernels whose input 0 is the handle of a table with key type
// K: Compute resolves it (checking the key dtype, and the row width when
// the op has a `dim` attribute) and hands the table to ComputeOnTable; an
// exception that escapes it (a file tier's read or write failing) becomes
// the kernel's status (TableWorkError) instead of ending the process.
template <typename K>
class TableOpKernel : public OpKernel {
 public:
  explicit TableOpKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (ctx->HasAttr("dim")) OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) final {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res, dim_));
    try {
      ComputeOnTable(ctx, res->table());
    } catch (const std::exception& e) {
      ctx->SetStatus(TableWorkError(e));
    }
  }

 protected:
  virtual void ComputeOnTable(OpKernelContext* ctx, kv::Table<K>& table) = 0;

  int64_t dim_ = -1;  // the op's `dim` attribute; -1 without one
};

// A kernel whose whole work is the function Fn(ctx, table), or with kFlag
// Fn(ctx, table, flag), `flag` the op's bool attribute named kFlag: the ops
// on one table without state of their own (sizes, counters, snapshots,
// eviction, export, import) are written as plain functions and registered
// with KRE_REGISTER_TABLE_FN or KRE_REGISTER_TABLE_FLAG_FN.
template <typename K, auto Fn, const char* kFlag = nullptr>
class TableFnKernel : public TableOpKernel<K> {
 public:
  explicit TableFnKernel(OpKernelConstruction* ctx) : TableOpKernel<K>(ctx) {
    if constexpr (kFlag != nullptr) OP_REQUIRES_OK(ctx, ctx->GetAttr(kFlag, &flag_));
  }

 protected:
  void ComputeOnTable(OpKernelContext* ctx, kv::Table<K>& table) override {
    if constexpr (kFlag != nullptr) {
      Fn(ctx, table, flag_);
    } else {
      Fn(ctx, table);
    }
  }

 private:
  bool flag_ = false;
};

// Allocates output i of `shape` and has fill(data) write its values of
// type T.
template <typename T, typename Fill>
absl::Status FillOutput(OpKernelContext* ctx, int i, const TensorShape& shape, Fill&& fill) {
  Tensor* out;
  TF_RETURN_IF_ERROR(ctx->allocate_output(i, shape, &out));
  fill(out->flat<T>().data());
  return absl::OkStatus();
}

// Allocates output i as a scalar of type T holding `value`.
template <typename T>
absl::Status SetScalarOutput(OpKernelContext* ctx, int i, T value) {
  return FillOutput<T>(ctx, i, TensorShape({}), [&](T* out) { *out = value; });
}

// Allocates output i as a vector holding `values`.
template <typename T>
absl::Status SetVectorOutput(OpKernelContext* ctx, int i, const std::vector<T>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  return FillOutput<T>(ctx, i, TensorShape({n}),
                       [&](T* out) { std::copy(values.begin(), values.end(), out); });
}

// Output i: the table's Bloom counters (kv::Table::BloomState), written
// into the output without a copy of them in between.
template <typename K>
absl::Status SetBloomOutput(OpKernelContext* ctx, int i, const kv::Table<K>& table) {
  const TensorShape shape({static_cast<int64_t>(table.BloomStateBytes())});
  return FillOutput<uint8_t>(ctx, i, shape, [&](uint8_t* out) { table.CopyBloomState(out); });
}

// For the `alloc` of kv::Table::Export / ExportChangedSince (called with
// every shard locked, so the slot list is stable): allocates outputs 0 .. 10
// of an export (see KRE_TABLE_EXPORT_OUTPUTS in csrc/ops/table_shape_fns.h)
// for n admitted keys and out_f filtered ones, fills in the slot names and
// widths and the EV-initializer matrix, and returns the buffers the table
// writes into; std::nullopt, with *status set, when an allocation fails.
template <typename K>
std::optional<typename kv::Table<K>::ExportBuffers> AllocateExportOutputs(OpKernelContext* ctx,
                                                                          const kv::Table<K>& table,
                                                                          int64_t n, int64_t out_f,
                                                                          absl::Status* status) {
  const int64_t dim = table.dim();
  const std::vector<kv::SlotSpec> specs = table.Slots();
  int64_t width = 0;
  for (const auto& s : specs) width += s.width;
  const int64_t num_slots = static_cast<int64_t>(specs.size());
  const std::vector<float> defaults = table.DefaultValues();
  const int64_t dvd = static_cast<int64_t>(defaults.size()) / dim;
  Tensor* t[11];
  const TensorShape shapes[11] = {
      TensorShape({n}),         TensorShape({n, dim}),   TensorShape({n}),
      TensorShape({n}),         TensorShape({n, width}), TensorShape({num_slots}),
      TensorShape({num_slots}), TensorShape({dvd, dim}), TensorShape({out_f}),
      TensorShape({out_f}),     TensorShape({out_f})};
  for (int i = 0; i < 11 && status->ok(); ++i) {
    status->Update(ctx->allocate_output(i, shapes[i], &t[i]));
  }
  if (!status->ok()) return std::nullopt;
  std::copy(defaults.begin(), defaults.end(), t[7]->flat<float>().data());
  for (int64_t j = 0; j < num_slots; ++j) {
    t[5]->flat<tf::tstring>()(j) = specs[j].name;
    t[6]->flat<int64_t>()(j) = specs[j].width;
  }
  return typename kv::Table<K>::ExportBuffers{
      t[0]->flat<K>().data(),       t[1]->flat<float>().data(),   t[2]->flat<int64_t>().data(),
      t[3]->flat<int64_t>().data(), t[4]->flat<float>().data(),   t[8]->flat<K>().data(),
      t[9]->flat<int64_t>().data(), t[10]->flat<int64_t>().data()};
}

// Registers the CPU kernel `Op<K>` of op `name` for both key types.
#define KRE_REGISTER_TABLE_KERNEL(name, Op)                                                       \
  REGISTER_KERNEL_BUILDER(                                                                        \
      Name(name).Device(::tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("Tkeys"), Op<int64_t>); \
  REGISTER_KERNEL_BUILDER(                                                                        \
      Name(name).Device(::tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("Tkeys"), Op<int32_t>)

// Registers the function template `fn` (void fn<K>(OpKernelContext*,
// kv::Table<K>&, bool flag)) as the CPU kernel of op `name` for both key
// types, `flag` its bool attribute named by the char array `flag_attr`.
#define KRE_REGISTER_TABLE_FLAG_FN(name, fn, flag_attr)                             \
  REGISTER_KERNEL_BUILDER(                                                          \
      Name(name).Device(::tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("Tkeys"), \
      ::kre::TableFnKernel<int64_t, fn<int64_t>, flag_attr>);                       \
  REGISTER_KERNEL_BUILDER(                                                          \
      Name(name).Device(::tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("Tkeys"), \
      ::kre::TableFnKernel<int32_t, fn<int32_t>, flag_attr>)

// Registers the function template `fn` (void fn<K>(OpKernelContext*,
// kv::Table<K>&)) as the CPU kernel of op `name` for both key types.
#define KRE_REGISTER_TABLE_FN(name, fn) KRE_REGISTER_TABLE_FLAG_FN(name, fn, nullptr)

// Runs fn(i) for i in [0, n): on this thread when not WorthSplitting, else
// over the intra-op pool, each thread taking the next i (ShareOverPool).
// Exceptions become a status (TableWorkError: DataLoss for a file tier's
// lost rows, else ResourceExhausted: allocation failure, a full shard or
// disk).
template <typename Fn>
absl::Status ParallelFor(tf::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit, Fn&& fn) {
  std::mutex mu;
  absl::Status status;
  auto item = [&](int64_t i) {
    try {
      fn(i);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      status = TableWorkError(e);
    }
  };
  if (!WorthSplitting(ctx, n, cost_per_unit)) {
    for (int64_t i = 0; i < n; ++i) item(i);
  } else {
    ShareOverPool(ctx, n, item);
  }
  return status;
}

// Groups keys by shard using the thread pool.
template <typename K>
kv::Partitioned<K> PartitionKeys(tf::OpKernelContext* ctx, const kv::Table<K>& table, const K* keys,
                                 int64_t n) {
  const int blocks = std::max(1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
  return kv::Partition(table, keys, n, blocks, [&](int num_blocks, auto&& fn) {
    // Each block hashes n / blocks keys (a few ns each).
    ParallelFor(ctx, num_blocks, 8 * (n / num_blocks + 1), [&](int64_t b) {
      fn(static_cast<int>(b));
    }).IgnoreError();
  });
}

}  // namespace kre

#endif  // KRE_KERNELS_TABLE_RESOURCE_H_
