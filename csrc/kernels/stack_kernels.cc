// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels of KRE>UnstackFeatureIds and KRE>UnstackKeptIds (see
// csrc/ops/stack_ops.cc): one pass over the stacked [batch, F, L] ids, row
// by row, each row's F runs of L ids copied (int32 widened) to the F
// outputs; KRE>UnstackKeptIds drops the ids < 0 on the way, without a
// branch. Rows (UnstackFeatureIds) or features (UnstackKeptIds, whose
// outputs' lengths are only known at the end) are split over the intra-op
// pool when the input is large.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/keep_rows.h"
#include "kernels/checked.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

namespace tf = ::tensorflow;

// Rows per block of the one-id copy: a block of the input (kBlock * F ids)
// stays in L1 while it is read once per feature.
constexpr int64_t kBlock = 128;

// Copies rows [begin, end) of ids [batch, F, L] to out[j] (feature j's
// [batch * L] ids). L is a compile-time constant (kL > 0) for the common
// short rows, so each run of L ids is a few moves, not a memcpy call.
template <typename T, int kL>
void CopyRows(const T* __restrict ids, int64_t f, int64_t l, int64_t begin, int64_t end,
              int64_t* const* out) {
  if constexpr (kL == 1) {  // one id per feature and row: a blocked transpose
    for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
      const int64_t b1 = std::min(end, b0 + kBlock);
      for (int64_t j = 0; j < f; ++j) {
        int64_t* __restrict dst = out[j];
        const T* __restrict src = ids + j;
        for (int64_t b = b0; b < b1; ++b) dst[b] = static_cast<int64_t>(src[b * f]);
      }
    }
  } else {
    const int64_t n = kL > 0 ? kL : l;
    for (int64_t b = begin; b < end; ++b) {
      const T* __restrict row = ids + b * f * n;
      for (int64_t j = 0; j < f; ++j) {
        int64_t* __restrict dst = out[j] + b * n;
        const T* __restrict src = row + j * n;
        if constexpr (kL == 0 && sizeof(T) == sizeof(int64_t)) {
          std::memcpy(dst, src, n * sizeof(int64_t));
        } else {
          for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<int64_t>(src[k]);
        }
      }
    }
  }
}

// CopyRows<T, l> for l in kLs (0 included: any length), else CopyRows<T, 0>.
template <typename T, int... kLs>
void CopyRowsOfLength(std::integer_sequence<int, kLs...>, const T* ids, int64_t f, int64_t l,
                      int64_t begin, int64_t end, int64_t* const* out) {
  if (!((l == kLs && (CopyRows<T, kLs>(ids, f, l, begin, end, out), true)) || ...)) {
    CopyRows<T, 0>(ids, f, l, begin, end, out);
  }
}

template <typename T>
void CopyRowsAnyLength(const T* ids, int64_t f, int64_t l, int64_t begin, int64_t end,
                       int64_t* const* out) {
  CopyRowsOfLength(std::make_integer_sequence<int, 9>(), ids, f, l, begin, end, out);
}

// What both kernels share: the `num_features` attribute, checked once, the
// check of their input against it, and the conversion of what Unstack
// throws into the op's status.
class StackedIdsOp : public tf::OpKernel {
 public:
  explicit StackedIdsOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_features", &num_features_));
    OP_REQUIRES(ctx, num_features_ >= 1,
                tf::errors::InvalidArgument("`num_features` must be >= 1, got ", num_features_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    ComputeChecked(ctx, [&] {
      const tf::Tensor& ids = ctx->input(0);
      OP_REQUIRES_OK(ctx, CheckIds(ids));
      Unstack(ctx, ids, ids.dim_size(0), ids.dim_size(1), ids.dim_size(2));
    });
  }

 protected:
  // Compute's body on the checked ids [batch, f, l]; what it throws becomes
  // its status.
  virtual void Unstack(tf::OpKernelContext* ctx, const tf::Tensor& ids, int64_t batch, int64_t f,
                       int64_t l) = 0;

 private:
  // The op's input must be ids [batch, num_features, L].
  absl::Status CheckIds(const tf::Tensor& ids) const {
    if (ids.dims() != 3) {
      return tf::errors::InvalidArgument(
          "`ids` must be [batch, num_features, length] (rank 3), got shape ",
          ids.shape().DebugString());
    }
    if (ids.dim_size(1) != num_features_) {
      return tf::errors::InvalidArgument("`ids` must have num_features = ", num_features_,
                                         " features in dimension 1, got shape ",
                                         ids.shape().DebugString());
    }
    return absl::OkStatus();
  }

  int num_features_ = 0;
};

template <typename T>
class UnstackKeptIdsOp : public StackedIdsOp {
 public:
  using StackedIdsOp::StackedIdsOp;

 protected:
  void Unstack(tf::OpKernelContext* ctx, const tf::Tensor& ids, int64_t batch, int64_t f,
               int64_t l) override {
    // Each feature's kept ids go to a buffer with room for all its ids;
    // its output is the kept prefix (a slice: no copy).
    std::vector<tf::Tensor> values(f);
    std::vector<int64_t*> out(f), splits(f);
    for (int64_t j = 0; j < f; ++j) {
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_temp(tf::DT_INT64, tf::TensorShape({batch * l}), &values[j]));
      out[j] = values[j].flat<int64_t>().data();
      tf::Tensor* s = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(f + j, tf::TensorShape({batch + 1}), &s));
      splits[j] = s->flat<int64_t>().data();
    }
    std::vector<int64_t> kept(f, 0);
    const T* src = ids.flat<T>().data();
    // ~1 cycle per id copied; small inputs stay on this thread.
    OP_REQUIRES_OK(ctx, ShardChecked(
                            ctx, f, batch * l,
                            [&](int64_t j0, int64_t j1) {
                              KeepRowsAnyLength(src, f, l, batch, j0, j1, out.data(), splits.data(),
                                                kept.data());
                            },
                            kKeepRowsRangesPerThread));
    for (int64_t j = 0; j < f; ++j) ctx->set_output(j, values[j].Slice(0, kept[j]));
  }
};

template <typename T>
class UnstackFeatureIdsOp : public StackedIdsOp {
 public:
  using StackedIdsOp::StackedIdsOp;

 protected:
  void Unstack(tf::OpKernelContext* ctx, const tf::Tensor& ids, int64_t batch, int64_t f,
               int64_t l) override {
    std::vector<int64_t*> out(f);
    for (int64_t j = 0; j < f; ++j) {
      tf::Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(j, tf::TensorShape({batch * l}), &t));
      out[j] = t->flat<int64_t>().data();
    }
    tf::Tensor* splits_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(f, tf::TensorShape({batch + 1}), &splits_t));
    int64_t* splits = splits_t->flat<int64_t>().data();
    for (int64_t b = 0; b <= batch; ++b) splits[b] = b * l;
    if (batch == 0 || l == 0) return;
    const T* src = ids.flat<T>().data();
    // ~1 cycle per id copied; small inputs stay on this thread.
    OP_REQUIRES_OK(ctx, ShardChecked(ctx, batch, f * l, [&](int64_t begin, int64_t end) {
                     CopyRowsAnyLength(src, f, l, begin, end, out.data());
                   }));
  }
};

// Registers the CPU kernel Op<T> of op `name` for int32 and int64 ids.
#define KRE_REGISTER_STACKED_IDS_KERNEL(name, Op)                                         \
  REGISTER_KERNEL_BUILDER(Name(name).Device(tf::DEVICE_CPU).TypeConstraint<int32_t>("T"), \
                          Op<int32_t>);                                                   \
  REGISTER_KERNEL_BUILDER(Name(name).Device(tf::DEVICE_CPU).TypeConstraint<int64_t>("T"), \
                          Op<int64_t>)

KRE_REGISTER_STACKED_IDS_KERNEL("KRE>UnstackFeatureIds", UnstackFeatureIdsOp);
KRE_REGISTER_STACKED_IDS_KERNEL("KRE>UnstackKeptIds", UnstackKeptIdsOp);

}  // namespace
}  // namespace kre
