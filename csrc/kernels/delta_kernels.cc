// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of the table's change tracking and counters (see csrc/ops/delta_ops.cc).
#include <string>
#include <vector>

#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;
namespace errors = tf::errors;

template <typename K>
class TableMarkChangesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = res->table().MarkChanges();
  }
};

template <typename K>
class TableExportChangedSinceOp : public OpKernel {
 public:
  explicit TableExportChangedSinceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res, dim_));
    kv::Table<K>& table = res->table();
    int64_t since;
    OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "since", &since));
    absl::Status status;
    using Buffers = typename kv::Table<K>::ExportBuffers;
    std::vector<K> erased;
    const bool complete = table.ExportChangedSince(
        since,
        [&](int64_t n, int64_t nf) -> std::optional<Buffers> {
          const std::vector<kv::SlotSpec> specs = table.Slots();
          int64_t width = 0;
          for (const auto& s : specs) width += s.width;
          const int64_t num_slots = static_cast<int64_t>(specs.size());
          const std::vector<float> defaults = table.DefaultValues();
          const int64_t dvd = static_cast<int64_t>(defaults.size()) / dim_;
          Tensor* t[11];
          const TensorShape shapes[11] = {
              TensorShape({n}),      TensorShape({n, dim_}),   TensorShape({n}),
              TensorShape({n}),      TensorShape({n, width}),  TensorShape({num_slots}),
              TensorShape({num_slots}), TensorShape({dvd, dim_}), TensorShape({nf}),
              TensorShape({nf}),     TensorShape({nf})};
          for (int i = 0; i < 11 && status.ok(); ++i) {
            status.Update(ctx->allocate_output(i, shapes[i], &t[i]));
          }
          if (!status.ok()) return std::nullopt;
          std::copy(defaults.begin(), defaults.end(), t[7]->flat<float>().data());
          for (int64_t j = 0; j < num_slots; ++j) {
            t[5]->flat<tf::tstring>()(j) = specs[j].name;
            t[6]->flat<int64_t>()(j) = specs[j].width;
          }
          return Buffers{t[0]->flat<K>().data(),       t[1]->flat<float>().data(),
                         t[2]->flat<int64_t>().data(), t[3]->flat<int64_t>().data(),
                         t[4]->flat<float>().data(),   t[8]->flat<K>().data(),
                         t[9]->flat<int64_t>().data(), t[10]->flat<int64_t>().data()};
        },
        &erased);
    OP_REQUIRES_OK(ctx, status);
    const std::vector<uint8_t> bloom = table.BloomState();
    Tensor *b, *e, *c;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            11, TensorShape({static_cast<int64_t>(bloom.size())}), &b));
    std::copy(bloom.begin(), bloom.end(), b->flat<uint8_t>().data());
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            12, TensorShape({static_cast<int64_t>(erased.size())}), &e));
    std::copy(erased.begin(), erased.end(), e->flat<K>().data());
    OP_REQUIRES_OK(ctx, ctx->allocate_output(13, TensorShape({}), &c));
    c->scalar<bool>()() = complete;
  }

 private:
  int64_t dim_;
};

template <typename K>
class TableTrimErasedOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res));
    int64_t upto;
    OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "upto", &upto));
    res->table().TrimErasedLog(upto);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = res->table().ErasedLogSize();
  }
};

template <typename K>
class TableEraseOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res));
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES_OK(ctx, validate::Vector(keys, "keys"));
    int64_t erased = 0;
    const K* k = keys.flat<K>().data();
    for (int64_t i = 0; i < keys.NumElements(); ++i) erased += res->table().Erase(k[i]);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = erased;
  }
};

template <typename K>
class TableCountersOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tf::core::RefCountPtr<TableResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res));
    const kv::Table<K>& t = res->table();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({10}), &out));
    auto v = out->flat<int64_t>();
    const kv::TableCounters c = t.Counters();
    v(0) = t.Size();
    v(1) = t.FilteredSize();
    v(2) = static_cast<int64_t>(t.MemoryBytes());
    v(3) = t.LatestStep();
    v(4) = static_cast<int64_t>(c.lookups);
    v(5) = static_cast<int64_t>(c.hits);
    v(6) = static_cast<int64_t>(c.admitted);
    v(7) = static_cast<int64_t>(c.erased);
    v(8) = t.ChangeEpoch();
    v(9) = t.ErasedLogSize();
  }
};

#define REGISTER(K)                                                                       \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("KRE>TableMarkChanges").Device(tf::DEVICE_CPU).TypeConstraint<K>("Tkeys"),     \
      TableMarkChangesOp<K>);                                                             \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("KRE>TableExportChangedSince").Device(tf::DEVICE_CPU).TypeConstraint<K>("Tkeys"), \
      TableExportChangedSinceOp<K>);                                                      \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("KRE>TableTrimErased").Device(tf::DEVICE_CPU).TypeConstraint<K>("Tkeys"),      \
      TableTrimErasedOp<K>);                                                              \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("KRE>TableErase").Device(tf::DEVICE_CPU).TypeConstraint<K>("Tkeys"),           \
      TableEraseOp<K>);                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("KRE>TableCounters").Device(tf::DEVICE_CPU).TypeConstraint<K>("Tkeys"),        \
      TableCountersOp<K>);

REGISTER(int64_t)
REGISTER(int32_t)
#undef REGISTER

}  // namespace
}  // namespace kre
