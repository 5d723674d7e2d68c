// Copyright keras_rec_emb authors. Apache-2.0.
// The fused sparse-apply kernel: one op per table and step dedupes keys, sums
// their gradient rows and updates value and slots in place with the rules of
// core/update_rules.h (shared with the JAX binding, csrc/jax/). The op
// receives the rule's hyper-parameter and slot names (attrs `hparam_names`,
// `slots`) and checks them at construction (rules::CheckNames).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/update_rules.h"
#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "kv/partition.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

using rules::DistinctRows;
using rules::WithRule;

// Checks one table's update: keys [n] and grads [n, dim], the rule's
// hyper-parameters (finite, as many as it takes), the step, and the slots
// the rule names (present in the table with the rule's widths); sets *n,
// *version and the slots' indices.
template <typename Rule, typename K>
absl::Status CheckApply(const std::string& rule, const std::vector<std::string>& slot_names,
                        const kv::Table<K>& table, const Tensor& keys, const Tensor& grads,
                        const Tensor& hyper, const Tensor& step, int64_t* n, int64_t* version,
                        std::vector<int>* slot_ids) {
  const int64_t dim = table.dim();
  TF_RETURN_IF_ERROR(validate::KeysAndRows(keys, grads, "grads", dim, n));
  if (!(hyper.dims() == 1 && hyper.dim_size(0) == Rule::kHyper)) {
    return errors::InvalidArgument("rule '", rule, "' takes ", Rule::kHyper,
                                   " hyper-parameters, got shape ", hyper.shape().DebugString());
  }
  TF_RETURN_IF_ERROR(validate::Scalar(step, "step", version));
  const float* h = hyper.flat<float>().data();
  TF_RETURN_IF_ERROR(validate::Finite(h, Rule::kHyper, "hyper"));
  const size_t needed = Rule::kSlots + (Rule::NeedsExtraSlot(h) ? 1 : 0);
  if (slot_names.size() != needed) {
    return errors::InvalidArgument("rule '", rule, "' ", Rule::kSlotsDoc, " needs ", needed,
                                   " slots, got ", slot_names.size());
  }
  slot_ids->clear();
  const std::vector<kv::SlotSpec> specs = table.Slots();
  for (size_t j = 0; j < slot_names.size(); ++j) {
    const std::string& name = slot_names[j];
    const int id = table.SlotIndex(name);
    if (id < 0) {
      return errors::FailedPrecondition("the embedding table has no optimizer slot '", name,
                                        "'; build the optimizer on the model's variables first");
    }
    const int64_t width = rules::SlotWidth<Rule>(j, dim);
    if (specs[id].width != width) {
      return errors::InvalidArgument("slot '", name, "' has width ", specs[id].width, ", rule '",
                                     rule, "' needs ", width);
    }
    slot_ids->push_back(id);
  }
  return absl::OkStatus();
}

// The update of shard s's keys of p (g: the gradient rows in batch order).
// kDistinct: the keys are distinct; else equal keys are summed first (in
// batch order, as kv::Table::Apply sums them), then the distinct keys
// applied with prefetching.
template <bool kDistinct, typename K, typename Update>
void ApplyShard(kv::Table<K>& table, const kv::Partitioned<K>& p, int s, const float* g,
                const std::vector<int>& slot_ids, int64_t version, const Update& update) {
  const int64_t b = p.offsets[s];
  const int64_t m = p.offsets[s + 1] - b;
  if (kDistinct) {
    table.ApplyDistinct(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, m, g,
                        slot_ids, version, update);
    return;
  }
  DistinctRows<K> d(m, table.dim());
  for (int64_t j = b; j < b + m; ++j) d.Add(p.keys[j], p.hashes[j], g + p.order[j] * table.dim());
  table.ApplyDistinct(s, d.keys.data(), d.hashes.data(), d.order.data(), d.size(), d.sums.data(),
                      slot_ids, version, update);
}

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
    const Tensor& keys = ctx->input(1);
    const Tensor& grads = ctx->input(2);
    int64_t n = 0, version = 0;
    std::vector<int> slot_ids;
    OP_REQUIRES_OK(ctx, CheckApply<Rule>(rule_, slot_names_, table, keys, grads, ctx->input(3),
                                         ctx->input(4), &n, &version, &slot_ids));
    if (n == 0) return;
    const int64_t dim = table.dim();
    const rules::ApplyRow<Rule> update(ctx->input(3).flat<float>().data(), dim);
    const K* k = keys.flat<K>().data();
    const float* g = grads.flat<float>().data();
    kv::Partitioned<K> p = PartitionKeys(ctx, table, k, n);
    const int64_t per_shard = n / table.num_shards() + 1;
    OP_REQUIRES_OK(
        ctx, ParallelFor(ctx, table.num_shards(), per_shard * (60 + 4 * dim), [&](int64_t s) {
          ApplyShard<kDistinct>(table, p, static_cast<int>(s), g, slot_ids, version, update);
        }));
  }

  std::string rule_;
  std::vector<std::string> slot_names_;
};

// KRE>GroupSparseApplyDistinct: KRE>TableSparseApplyDistinct of N tables
// in one op, one unit of the intra-op pool per table (its keys grouped by
// shard, then its shards applied, one after the other): a table's update
// is the same sequence whatever the number of threads, only tables run
// concurrently. All inputs are checked before any table is updated.
template <typename K>
class GroupSparseApplyDistinctOp : public OpKernel {
 public:
  explicit GroupSparseApplyDistinctOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slots", &slot_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_tables_));
    std::vector<std::string> hparam_names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hparam_names", &hparam_names));
    std::string error = "unknown rule " + rule_;
    WithRule(rule_, [&](auto tag) {
      error = rules::CheckNames<typename decltype(tag)::type>(rule_, hparam_names, slot_names_);
    });
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
  }

  void Compute(OpKernelContext* ctx) override {
    const bool known = WithRule(rule_, [&](auto tag) { Run<typename decltype(tag)::type>(ctx); });
    if (!known) ctx->SetStatus(errors::InvalidArgument("unknown rule ", rule_));
  }

 private:
  // Input i of input list `list` (handles, keys, grads, hyper; then step).
  const Tensor& In(OpKernelContext* ctx, int list, int i) const {
    return ctx->input(list * num_tables_ + i);
  }

  template <typename Rule>
  void Run(OpKernelContext* ctx) {
    const int N = num_tables_;
    std::vector<tf::core::RefCountPtr<TableResource<K>>> tables(N);
    std::vector<int64_t> n(N);
    std::vector<std::vector<int>> slot_ids(N);
    int64_t version = 0, total = 0;
    for (int t = 0; t < N; ++t) {
      tf::core::RefCountPtr<TableResourceBase> base;
      OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, t), &base));
      auto* typed = dynamic_cast<TableResource<K>*>(base.get());
      OP_REQUIRES(ctx, typed != nullptr,
                  errors::InvalidArgument(
                      "table ", t, " has key dtype ", tf::DataTypeString(base->key_dtype()),
                      " but the op was given ", tf::DataTypeString(tf::DataTypeToEnum<K>::v()),
                      " keys; cast the keys to the table's key dtype"));
      typed->Ref();
      tables[t].reset(typed);
      const absl::Status st =
          CheckApply<Rule>(rule_, slot_names_, typed->table(), In(ctx, 1, t), In(ctx, 2, t),
                           In(ctx, 3, t), ctx->input(4 * N), &n[t], &version, &slot_ids[t]);
      OP_REQUIRES(ctx, st.ok(),
                  absl::Status(st.code(),
                               absl::StrCat("table ", t, " of the group update: ", st.message())));
      total += n[t] * (100 + 4 * typed->dim());
    }
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, N, total / std::max(1, N) + 1, [&](int64_t t) {
                     if (n[t] > 0)
                       ApplyTable<Rule>(ctx, *tables[t], static_cast<int>(t), n[t], slot_ids[t],
                                        version);
                   }));
  }

  // Table t's update, shard after shard (its n keys grouped by shard here,
  // on this thread).
  template <typename Rule>
  void ApplyTable(OpKernelContext* ctx, TableResource<K>& resource, int t, int64_t n,
                  const std::vector<int>& slot_ids, int64_t version) const {
    kv::Table<K>& table = resource.table();
    const Tensor& keys = In(ctx, 1, t);
    const Tensor& grads = In(ctx, 2, t);
    const Tensor& hyper = In(ctx, 3, t);
    const rules::ApplyRow<Rule> update(hyper.flat<float>().data(), table.dim());
    const kv::Partitioned<K> p =
        kv::Partition(table, keys.flat<K>().data(), n, 1, [](int blocks, auto&& fn) {
          for (int b = 0; b < blocks; ++b) fn(b);
        });
    const float* g = grads.flat<float>().data();
    for (int s = 0; s < table.num_shards(); ++s) {
      ApplyShard<true>(table, p, s, g, slot_ids, version, update);
    }
  }

  std::string rule_;
  std::vector<std::string> slot_names_;
  int num_tables_ = 0;
};

template <typename K>
using TableSparseApplyOp = SparseApplyOp<K, false>;
template <typename K>
using TableSparseApplyDistinctOp = SparseApplyOp<K, true>;

KRE_REGISTER_TABLE_KERNEL("KRE>TableSparseApply", TableSparseApplyOp);
KRE_REGISTER_TABLE_KERNEL("KRE>TableSparseApplyDistinct", TableSparseApplyDistinctOp);
KRE_REGISTER_TABLE_KERNEL("KRE>GroupSparseApplyDistinct", GroupSparseApplyDistinctOp);

}  // namespace
}  // namespace kre
