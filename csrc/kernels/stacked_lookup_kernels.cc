// Copyright keras_rec_emb authors. Apache-2.0.
// Kernel of KRE>StackedPooledLookup (csrc/ops/stack_ops.cc): the inference
// lookup of the ids of F features stacked in one [batch, F, L] tensor.
//
// One pass over the ids splits them into each feature's kept ids and row
// splits (KeepRows, as KRE>UnstackKeptIds does: the input read once in
// order). Then every feature takes the pooled path (pooled_lookup.h), as a
// group lookup's pooled feature does after KRE>UnstackKeptIds, but without
// the op boundary between them and what the group lookup needs of it (its
// per-feature checks of ids and splits, copies of the splits, unique_ids and
// inverse outputs). Reading each feature's ids straight from the stacked
// tensor instead measured slower: a feature's ids lie F * L apart, and those
// strided loads missed for about a third of the op's time, prefetched or
// not. Outputs are bit-identical to the group lookup's.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/keep_rows.h"
#include "kernels/checked.h"
#include "kernels/pooled_combine.h"
#include "kernels/pooled_lookup.h"
#include "kernels/table_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

class StackedPooledLookupOp : public OpKernel {
 public:
  explicit StackedPooledLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    ComputeChecked(ctx, [&] { ComputeUnchecked(ctx); });
  }

  // Compute's body; what it throws becomes its status.
  void ComputeUnchecked(OpKernelContext* ctx) {
    const int T = num_tables_, F = num_features_;
    const Tensor& ids_t = ctx->input(T);
    OP_REQUIRES(ctx, ids_t.dims() == 3 && ids_t.dim_size(1) == F,
                errors::InvalidArgument("ids must be [batch, ", F, ", length], got ",
                                        ids_t.shape().DebugString()));
    std::vector<TableSlot> tables(T);
    for (int t = 0; t < T; ++t) {
      OP_REQUIRES_OK(ctx, ResolveTable(ctx, t, t, key_dtypes_[t], dims_[t], &tables[t]));
    }
    const int64_t batch = ids_t.dim_size(0), len = ids_t.dim_size(2);
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, width_}), &out_t));
    if (batch == 0) return;
    float* out = out_t->flat<float>().data();
    const int64_t per_row = std::max<int64_t>(len, 1);
    // Each feature's kept ids (room for all its ids) and row splits, in one
    // pass over the input (features split over the threads).
    Tensor kept_t, splits_t;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_temp(tf::DT_INT64, TensorShape({F, batch * len + 1}), &kept_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64, TensorShape({F, batch + 1}), &splits_t));
    std::vector<int64_t*> kept(F), splits(F);
    for (int f = 0; f < F; ++f) {
      kept[f] = kept_t.flat<int64_t>().data() + f * (batch * len + 1);
      splits[f] = splits_t.flat<int64_t>().data() + f * (batch + 1);
    }
    std::vector<int64_t> num_kept(F, 0);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    OP_REQUIRES_OK(ctx, ShardChecked(
                            ctx, F, batch * len,  // ~1 cycle an id
                            [&](int64_t j0, int64_t j1) {
                              if (ids_t.dtype() == tf::DT_INT64) {
                                KeepRowsAnyLength(ids_t.flat<int64_t>().data(), F, len, batch, j0,
                                                  j1, kept.data(), splits.data(), num_kept.data());
                              } else {
                                KeepRowsAnyLength(ids_t.flat<int32_t>().data(), F, len, batch, j0,
                                                  j1, kept.data(), splits.data(), num_kept.data());
                              }
                            },
                            kKeepRowsRangesPerThread));
    // Decided once here (a table's size may change under a concurrent
    // training lookup). Features of tables read shard by shard are one
    // unit each, with a row buffer for a chunk of their ids; the others
    // are split over the threads when there are fewer than two a thread.
    const int threads = workers->num_threads;
    const int64_t ranges = PooledRanges(threads, F, batch);
    struct Unit {
      int feature;
      int64_t begin, end;
      float* buffer;  // rows of a chunk, for a table read shard by shard
    };
    std::vector<Unit> units;
    std::vector<Tensor> buffers;
    for (int f = 0; f < F; ++f) {
      const TableSlot& t = tables[feature_tables_[f]];
      if (t.PrefersOrderedLookup(num_kept[f])) {
        for (int64_t r = 0; r < ranges; ++r) {
          units.push_back({f, batch * r / ranges, batch * (r + 1) / ranges, nullptr});
        }
        continue;
      }
      buffers.emplace_back();
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_temp(tf::DT_FLOAT,
                                        TensorShape({PooledBufferRows(num_kept[f], batch, per_row),
                                                     dims_[feature_tables_[f]]}),
                                        &buffers.back()));
      units.push_back({f, 0, batch, buffers.back().flat<float>().data()});
    }
    // Every other call walks the features in reverse: the tables read last
    // by one call are read first by the next, while still in the
    // last-level cache (as the group lookup does).
    if (calls_.fetch_add(1, std::memory_order_relaxed) & 1) {
      std::reverse(units.begin(), units.end());
    }
    std::vector<absl::Status> status(units.size());
    int64_t cost = 0;
    for (const Unit& u : units) cost += (u.end - u.begin) * per_row;
    cost = 60 * (cost / static_cast<int64_t>(units.size()) + 1);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, static_cast<int64_t>(units.size()), cost, [&](int64_t i) {
                     const Unit& u = units[i];
                     const int f = u.feature;
                     const PooledFeature pf{kept[f],
                                            splits[f],
                                            dims_[feature_tables_[f]],
                                            default_ids_[f],
                                            combiners_[f],
                                            out + columns_[f],
                                            width_,
                                            f,
                                            static_cast<int>(feature_tables_[f])};
                     status[i] =
                         PooledRows(tables[feature_tables_[f]], pf, u.begin, u.end, u.buffer);
                   }));
    for (const absl::Status& s : status) OP_REQUIRES_OK(ctx, s);
  }

 private:
  absl::Status Init(OpKernelConstruction* ctx) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &num_tables_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_features", &num_features_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("table_key_dtypes", &key_dtypes_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("table_dims", &dims_));
    std::vector<std::string> combiners;
    TF_RETURN_IF_ERROR(ctx->GetAttr("feature_tables", &feature_tables_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &combiners));
    TF_RETURN_IF_ERROR(ctx->GetAttr("default_ids", &default_ids_));
    const size_t T = static_cast<size_t>(num_tables_), F = static_cast<size_t>(num_features_);
    if (key_dtypes_.size() != T || dims_.size() != T) {
      return errors::InvalidArgument(
          "table_key_dtypes and table_dims must each have num_tables = ", num_tables_,
          " entries, got ", key_dtypes_.size(), " and ", dims_.size());
    }
    for (size_t t = 0; t < T; ++t) {
      if (dims_[t] < 1)
        return errors::InvalidArgument("table_dims[", t, "] must be >= 1, got ", dims_[t]);
    }
    if (feature_tables_.size() != F || combiners.size() != F || default_ids_.size() != F) {
      return errors::InvalidArgument(
          "feature_tables, combiners and default_ids must each have "
          "num_features = ",
          num_features_, " entries");
    }
    combiners_.resize(F);
    columns_.resize(F);
    width_ = 0;
    for (size_t f = 0; f < F; ++f) {
      const int64_t t = feature_tables_[f];
      if (t < 0 || t >= num_tables_) {
        return errors::InvalidArgument("feature_tables[", f, "] = ", t,
                                       " is not a table index in [0, ", num_tables_, ")");
      }
      if (!ParseCombiner(combiners[f], &combiners_[f])) {
        return errors::InvalidArgument("combiners[", f, "] must be sum, mean or sqrtn, got '",
                                       combiners[f], "'");
      }
      if (key_dtypes_[t] == tf::DT_INT32 && default_ids_[f] > std::numeric_limits<int32_t>::max()) {
        return errors::InvalidArgument("default_ids[", f, "] = ", default_ids_[f],
                                       " does not fit table ", t, "'s int32 keys");
      }
      columns_[f] = width_;
      width_ += dims_[t];
    }
    return absl::OkStatus();
  }

  int num_tables_ = 0;
  int num_features_ = 0;
  std::vector<tf::DataType> key_dtypes_;
  std::vector<int64_t> dims_;
  std::vector<int64_t> feature_tables_;
  std::vector<Combiner> combiners_;
  std::vector<int64_t> default_ids_;
  std::vector<int64_t> columns_;  // feature f's first output column
  int64_t width_ = 0;
  std::atomic<uint64_t> calls_{0};  // Compute calls (see the reverse walk)
};

REGISTER_KERNEL_BUILDER(Name("KRE>StackedPooledLookup").Device(tf::DEVICE_CPU),
                        StackedPooledLookupOp);

}  // namespace
}  // namespace kre
