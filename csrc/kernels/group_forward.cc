// Copyright keras_rec_emb authors. Apache-2.0.
// Kernel of KRE>GroupLookup (csrc/ops/group_ops.cc): all features of a
// group, over all their embedding tables and dense matrices, in one op.
//
// Each feature is read by one of two paths, by one rule:
//  * the pooled path (pooled_lookup.h) for a feature of an inference lookup
//    (no `insert`) that is the only feature of its table and has no weights
//    input, no max_norm and a pooled output (not a sequence): its kept ids
//    are looked up in batch order and combined straight into the output,
//    not deduplicated (unique_ids then lists every kept id, repeats too, and
//    inverse counts 0, 1, ...);
//  * the deduplicating path (distinct_lookup.h) for every other feature:
//    its parameter's ids are deduplicated over all its features, each
//    distinct key looked up once (counted as often as it occurs, so that
//    admission filters and frequencies see every occurrence), then each
//    feature combined through `inverse`. Training lookups take it always:
//    the backward and the optimizer's apply then handle each key once.
// Both give the same outputs (an id's row is the same whether it is read
// once or once per occurrence without `insert`; the combines are
// bit-identical for unweighted ids).
//
// Work is split over the intra-op pool in units: a pooled feature's rows
// in ranges; with at least two parameters a thread, one unit per
// deduplicated parameter that deduplicates, looks up and combines (the op
// waits on the pool once, and a parameter's rows are combined while in
// cache); with fewer, the deduplicated parameters go in phases (dedupe, then
// one unit per (table, shard) lookup, then blocks of rows combined).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels/checked.h"
#include "kernels/distinct_lookup.h"
#include "kernels/group_config.h"
#include "kernels/pooled_combine.h"
#include "kernels/pooled_lookup.h"
#include "kernels/table_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

// Whether parameter p's feature takes the pooled path (see the top).
bool PooledParam(OpKernelContext* ctx, const GroupConfig& cfg, bool insert, int p) {
  if (insert || !cfg.is_table(p) || cfg.features_of[p].size() != 1) return false;
  const int f = cfg.features_of[p][0];
  const FeatureAttrs& a = cfg.feature[f];
  const Tensor& weights = ctx->input(cfg.weights_input(f));
  return !a.sequence && a.max_norm <= 0 && weights.dims() == 1 && weights.dim_size(0) == 0;
}

// A unit of the forward's work: rows [begin, end) of a pooled parameter's
// feature (`buffer`: its chunk rows when its table is read shard by shard),
// or (begin < 0) a deduplicated parameter.
struct Unit {
  int param;
  int64_t begin, end;
  float* buffer;
};

class GroupLookupOp : public OpKernel {
 public:
  explicit GroupLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("insert", &insert_));
  }

  void Compute(OpKernelContext* ctx) override {
    ComputeChecked(ctx, [&] { ComputeUnchecked(ctx); });
  }

  // Compute's body; what it throws becomes its status.
  void ComputeUnchecked(OpKernelContext* ctx) {
    const GroupConfig& cfg = cfg_;
    const int F = cfg.num_features;
    const int P = cfg.num_params();
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    std::vector<char> pooled(P, 0);
    for (int p = 0; p < cfg.num_tables; ++p) pooled[p] = PooledParam(ctx, cfg, insert_, p);
    // Pooled features, and those whose kept ids suffice, are built in place.
    std::vector<Feature> features(F);
    {
      std::vector<absl::Status> status(F);
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, F, BuildFeatureCost(ctx, cfg), [&](int64_t f) {
                       const int fi = static_cast<int>(f);
                       status[f] =
                           BuildFeature(ctx, cfg, fi, &features[f],
                                        pooled[cfg.feature[fi].param] || KeptIdsSuffice(cfg, fi));
                     }));
      for (const auto& st : status) OP_REQUIRES_OK(ctx, st);
    }
    std::vector<float*> outs(F);
    OP_REQUIRES_OK(ctx, AllocateOutputs(ctx, &features, &outs));
    std::vector<ParamIds> params(P);
    std::vector<bool> combined(F, false);  // features combined by CombineRows
    for (int f = 0; f < F; ++f) combined[f] = !pooled[cfg.feature[f].param];
    std::vector<PooledFeature> pooled_features(P);
    std::vector<char> ordered(P, 0);
    for (int p = 0; p < cfg.num_tables; ++p) {
      if (!pooled[p]) continue;
      const int f = cfg.features_of[p][0];
      Feature& ft = features[f];
      OP_REQUIRES_OK(ctx, PooledOutputs(ctx, p, &ft));
      // Default ids are filled by BuildFeature already.
      pooled_features[p] = {
          ft.kept_ids(), ft.splits.data(),  cfg.dims[p], -1, cfg.feature[f].combiner,
          outs[f],       cfg.row_stride(f), f,           p};
      // Decided once here (the table's size may change under a concurrent
      // training lookup).
      ordered[p] = tables[p].PrefersOrderedLookup(ft.kept());
    }
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    const bool per_param = P >= 2 * threads;
    std::vector<Unit> units;
    std::vector<Tensor> buffers;
    int64_t total = 0;  // ids in all
    for (int p = 0; p < P; ++p) {
      int64_t n = 0;
      for (int f : cfg.features_of[p]) n += features[f].kept();
      total += n;
      if (!pooled[p]) {
        // Per parameter, the distinct rows go to a buffer with room for
        // every id (none repeats); in phases LookupDistinct sizes it.
        if (per_param && cfg.is_table(p)) {
          OP_REQUIRES_OK(ctx, PrepareRows(ctx, cfg, p, n, &params[p]));
        }
        units.push_back({p, -1, -1, nullptr});
        continue;
      }
      const int64_t batch = features[cfg.features_of[p][0]].batch;
      if (ordered[p]) {
        const int64_t ranges = PooledRanges(threads, P, batch);
        for (int64_t r = 0; r < ranges; ++r) {
          units.push_back({p, batch * r / ranges, batch * (r + 1) / ranges, nullptr});
        }
        continue;
      }
      buffers.emplace_back();
      const Feature& ft = features[cfg.features_of[p][0]];
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_temp(
                         tf::DT_FLOAT,
                         TensorShape({PooledBufferRows(ft.kept(), batch, ft.max_len), cfg.dims[p]}),
                         &buffers.back()));
      units.push_back({p, 0, batch, buffers.back().flat<float>().data()});
    }
    // Every other call walks the units in reverse: the tables read last by
    // one call are read first by the next, while still in the last-level
    // cache (all of a group's tables often exceed it: 26 tables of 15.5k
    // keys, dim 16, ~40 MB; a cyclic walk over more than the cache misses on
    // almost every line).
    if (calls_.fetch_add(1, std::memory_order_relaxed) & 1) {
      std::reverse(units.begin(), units.end());
    }
    std::vector<absl::Status> status(units.size());
    const int64_t cost = (per_param ? 200 : 60) * (total / std::max<int64_t>(1, units.size()) + 1);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, static_cast<int64_t>(units.size()), cost, [&](int64_t i) {
                     const Unit& u = units[i];
                     const int p = u.param;
                     if (u.begin >= 0) {
                       status[i] =
                           PooledRows(tables[p], pooled_features[p], u.begin, u.end, u.buffer);
                       return;
                     }
                     DedupeParam(cfg, tables, p, &features, &params[p]);
                     if (!per_param) return;  // looked up and combined in the phases below
                     if (cfg.is_table(p)) {
                       for (int sh = 0; sh < tables[p].num_shards(); ++sh) {
                         LookupShard(tables, p, sh, insert_, &params[p]);
                       }
                     }
                     for (int f : cfg.features_of[p]) {
                       CombineRows(ctx, cfg, params, features, f, 0, features[f].batch, outs[f]);
                     }
                   }));
    for (const absl::Status& s : status) OP_REQUIRES_OK(ctx, s);
    if (!per_param) {
      std::vector<bool> wanted(cfg.num_tables);
      for (int t = 0; t < cfg.num_tables; ++t) wanted[t] = !pooled[t];
      OP_REQUIRES_OK(ctx, LookupDistinct(ctx, cfg, tables, &params, insert_, wanted));
      OP_REQUIRES_OK(ctx, CombineBlocks(ctx, cfg, params, features, combined, outs));
    }
    for (int p = 0; p < P; ++p) {
      if (pooled[p]) continue;
      Tensor* u;
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_output(
                         F + p, TensorShape({static_cast<int64_t>(params[p].uniq.size())}), &u));
      std::copy(params[p].uniq.begin(), params[p].uniq.end(), u->flat<int64_t>().data());
    }
  }

 private:
  // The features' outputs (outs[f]: feature f's row 0; with `concat` its
  // first column of the one output) and inverse outputs (features[f].inverse).
  absl::Status AllocateOutputs(OpKernelContext* ctx, std::vector<Feature>* features,
                               std::vector<float*>* outs) const {
    const GroupConfig& cfg = cfg_;
    const int F = cfg.num_features;
    const int P = cfg.num_params();
    for (int f = 0; f < F; ++f) {
      Feature& ft = (*features)[f];
      Tensor* inv;
      TF_RETURN_IF_ERROR(ctx->allocate_output(F + P + f, TensorShape({ft.kept()}), &inv));
      ft.inverse = inv->flat<int32_t>().data();
      if (cfg.concat) {
        if (ft.batch != (*features)[0].batch) {
          return errors::InvalidArgument("concat = true needs one batch size, but feature ", f,
                                         " has ", ft.batch, " rows and feature 0 ",
                                         (*features)[0].batch);
        }
        Tensor* out;
        TF_RETURN_IF_ERROR(ctx->allocate_output(
            f, f == 0 ? TensorShape({ft.batch, cfg.width}) : TensorShape({0}), &out));
        if (f == 0) (*outs)[0] = out->flat<float>().data();
        continue;
      }
      const int64_t dim = cfg.dims[cfg.feature[f].param];
      const TensorShape shape = cfg.feature[f].sequence ? TensorShape({ft.batch, ft.max_len, dim})
                                                        : TensorShape({ft.batch, dim});
      Tensor* out;
      TF_RETURN_IF_ERROR(ctx->allocate_output(f, shape, &out));
      (*outs)[f] = out->flat<float>().data();
    }
    if (cfg.concat) {
      for (int f = F - 1; f >= 0; --f) (*outs)[f] = (*outs)[0] + cfg.feature[f].column;
    }
    return absl::OkStatus();
  }

  // A pooled parameter p's unique_ids (every kept id of its feature ft, in
  // order: its ids input as it is when BuildFeature read it in place) and
  // its feature's inverse (0, 1, ...).
  absl::Status PooledOutputs(OpKernelContext* ctx, int p, Feature* ft) const {
    const int F = cfg_.num_features;
    const int64_t n = ft->kept();
    if (ft->given) {
      ctx->set_output(F + p, ctx->input(cfg_.ids_input(cfg_.features_of[p][0])));
    } else {
      Tensor* u;
      TF_RETURN_IF_ERROR(ctx->allocate_output(F + p, TensorShape({n}), &u));
      std::copy(ft->raw.get(), ft->raw.get() + n, u->flat<int64_t>().data());
    }
    for (int64_t j = 0; j < n; ++j) ft->inverse[j] = static_cast<int32_t>(j);
    return absl::OkStatus();
  }

  GroupConfig cfg_;
  bool insert_;
  std::atomic<uint64_t> calls_{0};  // Compute calls (see the reverse walk)
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookup").Device(tf::DEVICE_CPU), GroupLookupOp);

}  // namespace
}  // namespace kre
