// Copyright keras_rec_emb authors. Apache-2.0.
// The fused sparse-apply kernel: one op per table and step dedupes keys, sums
// their gradient rows and updates value and slots in place with the rules of
// core/update_rules.h (shared with the JAX binding, csrc/jax/). The op
// receives the rule's hyper-parameter and slot names (attrs `hparam_names`,
// `slots`) and checks them at construction (rules::CheckNames).
#include <string>
#include <vector>

#include "core/update_rules.h"
#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

using rules::DistinctRows;
using rules::WithRule;

// kDistinct: the op promises distinct keys (KRE>TableSparseApplyDistinct,
// fed by the group lookup's backward) and the table skips its dedupe.
template <typename K, bool kDistinct>
class SparseApplyOp : public TableOpKernel<K> {
 public:
  explicit SparseApplyOp(OpKernelConstruction* ctx) : TableOpKernel<K>(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slots", &slot_names_));
    std::vector<std::string> hparam_names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hparam_names", &hparam_names));
    OP_REQUIRES_OK(ctx, CheckRuleNames(hparam_names));
  }

  void ComputeOnTable(OpKernelContext* ctx, kv::Table<K>& table) override {
    const bool known =
        WithRule(rule_, [&](auto tag) { Run<typename decltype(tag)::type>(ctx, table); });
    if (!known) ctx->SetStatus(errors::InvalidArgument("unknown rule ", rule_));
  }

 private:
  tf::Status CheckRuleNames(const std::vector<std::string>& hparams) const {
    tf::Status status = errors::InvalidArgument("unknown rule ", rule_);
    WithRule(rule_, [&](auto tag) { status = CheckNames<typename decltype(tag)::type>(hparams); });
    return status;
  }

  // The names the op received against the rule's own (rules::CheckNames).
  template <typename Rule>
  tf::Status CheckNames(const std::vector<std::string>& hparams) const {
    const std::string error = rules::CheckNames<Rule>(rule_, hparams, slot_names_);
    return error.empty() ? absl::OkStatus() : errors::InvalidArgument(error);
  }

  template <typename Rule>
  void Run(OpKernelContext* ctx, kv::Table<K>& table) {
    const int64_t dim = table.dim();
    const Tensor& keys = ctx->input(1);
    const Tensor& grads = ctx->input(2);
    const Tensor& hyper = ctx->input(3);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, validate::KeysAndRows(keys, grads, "grads", dim, &n));
    OP_REQUIRES(
        ctx, hyper.dims() == 1 && hyper.dim_size(0) == Rule::kHyper,
        errors::InvalidArgument("rule '", rule_, "' takes ", Rule::kHyper,
                                " hyper-parameters, got shape ", hyper.shape().DebugString()));
    int64_t version;
    OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(4), "step", &version));
    const float* h = hyper.flat<float>().data();
    OP_REQUIRES_OK(ctx, validate::Finite(h, Rule::kHyper, "hyper"));
    const size_t needed = Rule::kSlots + (Rule::NeedsExtraSlot(h) ? 1 : 0);
    OP_REQUIRES(ctx, slot_names_.size() == needed,
                errors::InvalidArgument("rule '", rule_, "' ", Rule::kSlotsDoc, " needs ", needed,
                                        " slots, got ", slot_names_.size()));
    std::vector<int> slot_ids;
    const std::vector<kv::SlotSpec> specs = table.Slots();
    for (size_t j = 0; j < slot_names_.size(); ++j) {
      const std::string& name = slot_names_[j];
      const int id = table.SlotIndex(name);
      OP_REQUIRES(
          ctx, id >= 0,
          errors::FailedPrecondition("the embedding table has no optimizer slot '", name,
                                     "'; build the optimizer on the model's variables first"));
      const int64_t width = rules::SlotWidth<Rule>(j, dim);
      OP_REQUIRES(ctx, specs[id].width == width,
                  errors::InvalidArgument("slot '", name, "' has width ", specs[id].width,
                                          ", rule '", rule_, "' needs ", width));
      slot_ids.push_back(id);
    }
    if (n == 0) return;
    const rules::ApplyRow<Rule> update(h, dim);
    const K* k = keys.flat<K>().data();
    const float* g = grads.flat<float>().data();
    kv::Partitioned<K> p = PartitionKeys(ctx, table, k, n);
    const int64_t per_shard = n / table.num_shards() + 1;
    OP_REQUIRES_OK(
        ctx, ParallelFor(ctx, table.num_shards(), per_shard * (60 + 4 * dim), [&](int64_t s) {
          const int64_t b = p.offsets[s];
          const int64_t m = p.offsets[s + 1] - b;
          if (kDistinct) {
            table.ApplyDistinct(static_cast<int>(s), p.keys.data() + b, p.hashes.data() + b,
                                p.order.data() + b, m, g, slot_ids, version, update);
            return;
          }
          // Equal keys summed here (in batch order, as kv::Table::Apply
          // sums them), then the distinct keys applied with prefetching.
          DistinctRows<K> d(m, dim);
          for (int64_t j = b; j < b + m; ++j) {
            d.Add(p.keys[j], p.hashes[j], g + p.order[j] * dim);
          }
          table.ApplyDistinct(static_cast<int>(s), d.keys.data(), d.hashes.data(), d.order.data(),
                              d.size(), d.sums.data(), slot_ids, version, update);
        }));
  }

  std::string rule_;
  std::vector<std::string> slot_names_;
};

template <typename K>
using TableSparseApplyOp = SparseApplyOp<K, false>;
template <typename K>
using TableSparseApplyDistinctOp = SparseApplyOp<K, true>;

KRE_REGISTER_TABLE_KERNEL("KRE>TableSparseApply", TableSparseApplyOp);
KRE_REGISTER_TABLE_KERNEL("KRE>TableSparseApplyDistinct", TableSparseApplyDistinctOp);

}  // namespace
}  // namespace kre
