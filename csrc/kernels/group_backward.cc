// Copyright keras_rec_emb authors. Apache-2.0.
// Kernel of KRE>GroupLookupGrad (csrc/ops/group_ops.cc), the backward of
// the group lookup: (1) per feature, its kept ids and weights as the forward
// built them (group_config.h);  (2) per (parameter, range of distinct ids),
// the row gradients summed through the forward's `inverse` (no hashing, no
// table access unless a max_norm clip must be differentiated, which reads
// the distinct rows as the deduplicating path does: distinct_lookup.h).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/pooled_rows.h"
#include "kernels/checked.h"
#include "kernels/distinct_lookup.h"
#include "kernels/group_config.h"
#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

class GroupLookupGradOp : public OpKernel {
 public:
  explicit GroupLookupGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, cfg_.Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    ComputeChecked(ctx, [&] { ComputeUnchecked(ctx); });
  }

  // Compute's body; what it throws becomes its status.
  void ComputeUnchecked(OpKernelContext* ctx) {
    const GroupConfig& cfg = cfg_;
    const int P = cfg.num_params();
    const int F = cfg.num_features;
    OP_REQUIRES_OK(ctx, CheckDense(ctx, cfg));
    std::vector<TableSlot> tables;
    OP_REQUIRES_OK(ctx, ResolveTables(ctx, cfg, &tables));
    std::vector<Feature> features;
    OP_REQUIRES_OK(ctx, BuildFeatures(ctx, cfg, &features));
    const int uniq0 = P + 3 * F, inverse0 = uniq0 + P, grads0 = inverse0 + F;
    std::vector<ParamIds> params(P);
    for (int p = 0; p < P; ++p) {
      const Tensor& u = ctx->input(uniq0 + p);
      OP_REQUIRES_OK(ctx, validate::Vector(u, ("unique_ids[" + std::to_string(p) + "]").c_str()));
      const int64_t* d = u.flat<int64_t>().data();
      params[p].uniq.assign(d, d + u.dim_size(0));
    }
    std::vector<const float*> grads(F);
    for (int f = 0; f < F; ++f) {
      Feature& ft = features[f];
      const int p = cfg.feature[f].param;
      const Tensor& inv = ctx->input(inverse0 + f);
      const std::string inv_name = "inverse[" + std::to_string(f) + "]";
      // One entry per id kept after pruning and default filling.
      OP_REQUIRES_OK(
          ctx,
          validate::Vector(inv, (inv_name + " (one entry per looked-up id)").c_str(), ft.kept()));
      ft.inverse = const_cast<int32_t*>(inv.flat<int32_t>().data());
      const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
      OP_REQUIRES_OK(ctx, validate::InRange(ft.inverse, ft.kept(), 0, num_uniq, inv_name));
      if (cfg.concat && f > 0) {
        OP_REQUIRES(
            ctx, ft.batch == features[0].batch,
            errors::InvalidArgument("concat = true needs one batch size, but feature ", f, " has ",
                                    ft.batch, " rows and feature 0 ", features[0].batch));
        grads[f] = grads[0] + cfg.feature[f].column;
        continue;
      }
      const Tensor& g = ctx->input(grads0 + f);
      const int64_t dim = cfg.concat ? cfg.width : cfg.dims[p];
      const TensorShape want = cfg.feature[f].sequence ? TensorShape({ft.batch, ft.max_len, dim})
                                                       : TensorShape({ft.batch, dim});
      OP_REQUIRES(ctx, g.shape() == want,
                  errors::InvalidArgument("output_grads[", f, "] must be ", want.DebugString(),
                                          ", got ", g.shape().DebugString()));
      grads[f] = g.flat<float>().data();
    }
    // Rows are needed only to differentiate the max_norm clip.
    std::vector<bool> wanted(cfg.num_tables, false);
    for (int f = 0; f < F; ++f) {
      const int p = cfg.feature[f].param;
      if (cfg.is_table(p) && cfg.feature[f].max_norm > 0) wanted[p] = true;
    }
    for (int t = 0; t < cfg.num_tables; ++t) {
      if (!wanted[t]) continue;
      ParamIds& ids = params[t];
      ids.hashes.resize(ids.uniq.size());
      for (size_t u = 0; u < ids.uniq.size(); ++u) ids.hashes[u] = tables[t].Hash(ids.uniq[u]);
      PartitionDistinct(tables[t], &ids);
      ids.counts.assign(ids.uniq.size(), 1);
    }
    OP_REQUIRES_OK(ctx, LookupDistinct(ctx, cfg, tables, &params, false, wanted));

    // Units: (parameter, range of distinct ids); a unit scans all ids of
    // its parameter and sums those in its range, so no two units write the
    // same row.
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    std::vector<int> num_ranges(P), first_unit(P + 1, 0);
    std::vector<float*> outs(P);
    for (int p = 0; p < P; ++p) {
      const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(p, TensorShape({num_uniq, cfg.dims[p]}), &out));
      outs[p] = out->flat<float>().data();  // each unit zeroes its rows
      num_ranges[p] =
          static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, num_uniq / 16384)));
      first_unit[p + 1] = first_unit[p] + num_ranges[p];
    }
    std::vector<int> unit_param(first_unit[P]);
    for (int p = 0; p < P; ++p) {
      for (int u = first_unit[p]; u < first_unit[p + 1]; ++u) unit_param[u] = p;
    }
    int64_t total = 0;
    for (const Feature& ft : features) total += ft.kept();
    const int64_t cost = 20 * (total / std::max(1, first_unit[P]) + 1);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, first_unit[P], cost, [&](int64_t unit) {
                     const int p = unit_param[unit];
                     const int64_t num_uniq = static_cast<int64_t>(params[p].uniq.size());
                     const int r = static_cast<int>(unit - first_unit[p]);
                     const int64_t lo = num_uniq * r / num_ranges[p];
                     const int64_t hi = num_uniq * (r + 1) / num_ranges[p];
                     std::fill(outs[p] + lo * cfg.dims[p], outs[p] + hi * cfg.dims[p], 0.0f);
                     AccumulateAnyWidth(ctx, cfg, params, features, grads, p, lo, hi, outs[p]);
                   }));
  }

 private:
  // Accumulate for parameter p's width.
  static void AccumulateAnyWidth(OpKernelContext* ctx, const GroupConfig& cfg,
                                 const std::vector<ParamIds>& params,
                                 const std::vector<Feature>& features,
                                 const std::vector<const float*>& grads, int p, int64_t lo,
                                 int64_t hi, float* out) {
    switch (cfg.dims[p]) {
#define KRE_ACCUMULATE_CASE(D) \
  case D:                      \
    return Accumulate<D>(ctx, cfg, params, features, grads, p, lo, hi, out);
      KRE_ACCUMULATE_CASE(4)
      KRE_ACCUMULATE_CASE(8)
      KRE_ACCUMULATE_CASE(16)
      KRE_ACCUMULATE_CASE(32)
      KRE_ACCUMULATE_CASE(64)
#undef KRE_ACCUMULATE_CASE
      default:
        return Accumulate<0>(ctx, cfg, params, features, grads, p, lo, hi, out);
    }
  }

  // D: the parameter's width when known at compile time (the common
  // widths: the row sums unroll into whole vectors), else 0. Every element
  // gets the same operations in the same order for every D.
  template <int D>
  static void Accumulate(OpKernelContext* ctx, const GroupConfig& cfg,
                         const std::vector<ParamIds>& params, const std::vector<Feature>& features,
                         const std::vector<const float*>& grads, int p, int64_t lo, int64_t hi,
                         float* out) {
    const int64_t dim = D > 0 ? D : cfg.dims[p];
    std::vector<float> g(dim);
    // Rows of a pooled feature's output gradient lie row_stride apart (the
    // whole concat row with `concat`): prefetched kAhead rows ahead, since
    // the hardware prefetcher loses such strides at page boundaries.
    constexpr int64_t kAhead = 8;
    for (int f : cfg.features_of[p]) {
      const Feature& ft = features[f];
      const float max_norm = cfg.feature[f].max_norm;
      const bool sequence = cfg.feature[f].sequence;
      const int64_t stride = sequence ? 0 : cfg.row_stride(f);
      const Combiner combiner = cfg.feature[f].combiner;
      const int32_t* inverse = ft.inverse;
      // Unweighted: weights of 1 (c * 1 is c; none stored when built in place).
      const float* weights = ft.weighted ? ft.weights.data() : nullptr;
      const float* grad = grads[f];
      for (int64_t b = 0; b < ft.batch; ++b) {
        if (!sequence && b + kAhead < ft.batch) {
          const float* ahead = grad + (b + kAhead) * stride;
          __builtin_prefetch(ahead);
          __builtin_prefetch(ahead + dim - 1);
        }
        const int64_t begin = ft.splits[b], end = ft.splits[b + 1];
        if (begin == end) continue;
        float c = -1.0f;  // computed on first use
        for (int64_t j = begin; j < end; ++j) {
          const int64_t u = inverse[j];
          if (u < lo || u >= hi) continue;
          if (c < 0) c = sequence ? 1.0f : CombinerScale(ft, combiner, b);
          const float* dout =
              sequence ? grad + (b * ft.max_len + (j - begin)) * dim : grad + b * stride;
          const float s = weights != nullptr ? c * weights[j] : c;
          float* acc = out + u * dim;
          if (max_norm <= 0) {
            AddScaled<D>(acc, s, dout, dim);
            continue;
          }
          for (int64_t d = 0; d < dim; ++d) g[d] = s * dout[d];
          // d/dx of x * m / max(|x|, m): (m/|x|)(g - x (x.g) / |x|^2).
          const float* x = cfg.is_table(p) ? params[p].rows + u * dim
                                           : ctx->input(p).flat<float>().data() + ft.ids[j] * dim;
          float norm = 0;
          if (ClipScale(x, dim, max_norm, &norm) < 1.0f) {
            float xg = 0;
            for (int64_t d = 0; d < dim; ++d) xg += x[d] * g[d];
            const float k = xg / (norm * norm);
            const float rr = max_norm / norm;
            for (int64_t d = 0; d < dim; ++d) g[d] = rr * (g[d] - x[d] * k);
          }
          for (int64_t d = 0; d < dim; ++d) acc[d] += g[d];
        }
      }
    }
  }

  GroupConfig cfg_;
};

REGISTER_KERNEL_BUILDER(Name("KRE>GroupLookupGrad").Device(tf::DEVICE_CPU), GroupLookupGradOp);

}  // namespace
}  // namespace kre
