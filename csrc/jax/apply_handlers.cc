// Copyright keras_rec_emb authors. Apache-2.0.
//
// The sparse updates' XLA FFI handlers: an update rule (core/update_rules.h,
// as the TensorFlow kernel's) applied to the rows of a batch's ids, from
// per-id gradients (Apply) or from a combiner's per-row gradients
// (ApplyPooled, and ApplyDistinct through the distinct ids of
// PooledLookupDistinct). handlers.h says what every handler shares;
// pooled_ids.h what the combiners' calls do.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/update_rules.h"
#include "jax/handlers.h"
#include "jax/pooled_ids.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace kre {
namespace jaxbind {
namespace {

// Checks rule `rule`'s hyper-parameters and the table's slots it names;
// returns the slots' indices.
template <typename Rule, typename K>
ffi::ErrorOr<std::vector<int>> RuleSlots(const kv::Table<K>& table, const string& rule,
                                         const std::vector<string>& slot_names,
                                         ffi::Span<const int64_t> hyper_dims, const float* h) {
  if (hyper_dims.size() != 1 || hyper_dims[0] != Rule::kHyper) {
    return ffi::Unexpected(Invalid("rule '" + rule + "' takes " + std::to_string(Rule::kHyper) +
                                   " hyper-parameters, got shape " + Shape(hyper_dims)));
  }
  for (int i = 0; i < Rule::kHyper; ++i) {
    if (!std::isfinite(h[i])) {
      return ffi::Unexpected(Invalid("`hyper` must be finite; " + string(Rule::kHyperNames[i]) +
                                     " is " + std::to_string(h[i])));
    }
  }
  const size_t needed = Rule::kSlots + (Rule::NeedsExtraSlot(h) ? 1 : 0);
  if (slot_names.size() != needed) {
    return ffi::Unexpected(Invalid("rule '" + rule + "' " + Rule::kSlotsDoc + " needs " +
                                   std::to_string(needed) + " slots, got " +
                                   std::to_string(slot_names.size())));
  }
  std::vector<int> slot_ids;
  const std::vector<kv::SlotSpec> specs = table.Slots();
  for (size_t j = 0; j < slot_names.size(); ++j) {
    const int id = table.SlotIndex(slot_names[j]);
    if (id < 0) {
      return ffi::Unexpected(
          Precondition("the embedding table has no optimizer slot '" + slot_names[j] +
                       "'; add it (add_slot) before applying rule '" + rule + "'"));
    }
    const int64_t width = rules::SlotWidth<Rule>(j, table.dim());
    if (specs[id].width != width) {
      return ffi::Unexpected(Invalid("slot '" + slot_names[j] + "' has width " +
                                     std::to_string(specs[id].width) + ", rule '" + rule +
                                     "' needs " + std::to_string(width)));
    }
    slot_ids.push_back(id);
  }
  return slot_ids;
}

// grad_of(i) is the gradient row of keys[i]. The sums are made here (they
// read the call's operands), their updates of the table maybe after the
// call returned (Defer).
template <typename Rule, typename K, typename GradOf>
ffi::Error ApplyRule(ffi::ThreadPool& pool, AnyTable& at, kv::Table<K>& table, const string& rule,
                     const std::vector<string>& slot_names, const K* keys, int64_t n,
                     GradOf&& grad_of, ffi::Span<const int64_t> hyper_dims, const float* h,
                     int64_t step) {
  const int64_t dim = table.dim();
  auto checked = RuleSlots<Rule>(table, rule, slot_names, hyper_dims, h);
  if (checked.has_error()) return checked.error();
  const std::vector<int>& slot_ids = *checked;
  if (n == 0) return ffi::Error::Success();
  const rules::ApplyRow<Rule> update(h, dim);
  // Equal keys summed per shard in batch order (as the TF kernel does),
  // then each shard's distinct keys applied with prefetching. The gradient
  // rows are read once, in batch order: gathered shard by shard they are
  // read at random, which costs more than the sums.
  const int shards = table.num_shards();
  std::vector<uint64_t> hashes(n);
  std::vector<int32_t> shard_of(n);
  std::vector<int64_t> counts(shards, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = kv::Table<K>::Hash(keys[i]);
    shard_of[i] = table.ShardOf(hashes[i]);
    ++counts[shard_of[i]];
  }
  std::vector<rules::DistinctRows<K>> d;
  d.reserve(shards);
  for (int s = 0; s < shards; ++s) d.emplace_back(counts[s], dim);
  for (int64_t i = 0; i < n; ++i) d[shard_of[i]].Add(keys[i], hashes[i], grad_of(i));
  auto apply = [&table, slot_ids, step, update](const std::vector<rules::DistinctRows<K>>& d) {
    for (int s = 0; s < table.num_shards(); ++s) {
      table.ApplyDistinct(s, d[s].keys.data(), d[s].hashes.data(), d[s].order.data(), d[s].size(),
                          d[s].sums.data(), slot_ids, step, update);
    }
  };
  if (!Deferrable(pool)) {
    apply(d);
  } else {
    Defer(pool, at, [apply, d = std::move(d)] { apply(d); });
  }
  return ffi::Error::Success();
}

// An update with rule Rule on a table with keys K, once its names checked
// (WithCheckedRule): the rule's name, slots, hyper-parameters and step.
template <typename RuleT, typename K>
struct RuleCall {
  using Key = K;
  using Rule = RuleT;

  // RuleSlots of this call: the slots' indices, or the error.
  ffi::ErrorOr<std::vector<int>> Slots() const {
    return RuleSlots<RuleT>(table, rule, slots, hyper.dimensions(), hyper.typed_data());
  }
  // ApplyRule of keys[0..n), grad_of(i) the gradient row of keys[i].
  template <typename GradOf>
  ffi::Error Apply(const K* keys, int64_t n, GradOf&& grad_of) const {
    return ApplyRule<RuleT>(pool, any, table, rule, slots, keys, n, std::forward<GradOf>(grad_of),
                            hyper.dimensions(), hyper.typed_data(), step);
  }

  ffi::ThreadPool& pool;
  AnyTable& any;
  kv::Table<K>& table;
  const string& rule;
  const std::vector<string>& slots;
  const ffi::Buffer<ffi::F32>& hyper;
  int64_t step;
};

// fn(RuleCall<Rule, K>) for update rule `rule_name` on `at` (see
// WithCheckedRule).
template <typename Fn>
ffi::Error WithRuleCall(ffi::ThreadPool& pool, AnyTable& at, std::string_view rule_name,
                        std::string_view hparam_names, std::string_view slot_names,
                        const ffi::Buffer<ffi::F32>& hyper, int64_t step, Fn&& fn) {
  return WithCheckedRule(
      at, rule_name, hparam_names, slot_names,
      [&](auto tag, auto& tab, const string& rule, const std::vector<string>& slots) {
        using Rule = typename decltype(tag)::type;
        return fn(RuleCall<Rule, KeyOfT<decltype(tab)>>{pool, at, tab, rule, slots, hyper, step});
      });
}

ffi::Error Apply(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> grads,
                 ffi::Buffer<ffi::F32> hyper, ffi::AnyBuffer step, ffi::Result<ffi::Token>,
                 int64_t table, std::string_view rule_name, std::string_view hparam_names,
                 std::string_view slot_names, bool prune, ffi::ThreadPool pool) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (ffi::Error e = CheckRows(keys.dimensions(), grads.dimensions(), at.dim(), "grads");
        e.failure()) {
      return e;
    }
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const int64_t n = static_cast<int64_t>(keys.element_count());
    const int64_t dim = at.dim();
    const float* g = grads.typed_data();
    auto apply = [&](auto call) -> ffi::Error {
      using K = typename decltype(call)::Key;
      const K* k = keys.reinterpret_data<K>();
      std::vector<int64_t> kept;
      if (prune) kept = KeptPositions(k, n);
      if (!prune || static_cast<int64_t>(kept.size()) == n) {  // no padding
        return call.Apply(k, n, [g, dim](int64_t i) { return g + i * dim; });
      }
      const std::vector<K> kept_keys = KeysAt(k, kept);
      // The gradient of kept id j is read in place, at its position.
      const int64_t* pos = kept.data();
      return call.Apply(kept_keys.data(), static_cast<int64_t>(kept.size()),
                        [g, dim, pos](int64_t j) { return g + pos[j] * dim; });
    };
    return WithRuleCall(pool, at, rule_name, hparam_names, slot_names, hyper, *version, apply);
  });
}

ffi::Error ApplyPooled(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::F32, 2> grads, ffi::Buffer<ffi::F32> hyper,
                       ffi::AnyBuffer step, ffi::Result<ffi::Token>, int64_t table,
                       std::string_view rule_name, std::string_view hparam_names,
                       std::string_view slot_names, bool prune, std::string_view combiner,
                       ffi::ThreadPool pool) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    auto comb = CheckPooledCall(at, keys, weights, combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = keys.dimensions()[0], len = keys.dimensions()[1], dim = at.dim();
    if (ffi::Error e = CheckShape2(grads.dimensions(), "grads", rows, dim); e.failure()) return e;
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const float* w = OptionalWeights(weights);
    auto apply_pooled = [&](auto call) -> ffi::Error {
      using K = typename decltype(call)::Key;
      const PooledIds<K> p(keys.reinterpret_data<K>(), w, rows, len, prune, *comb);
      // Each id's gradient is made where the apply reads it
      // (DistinctRows copies or adds it at once).
      std::vector<float> one(dim);
      const float* g = grads.typed_data();
      auto grad_of = [&](int64_t i) {
        const int32_t r = p.row[i];
        const float s = p.w[i] * p.inv[r];
        const float* src = g + static_cast<int64_t>(r) * dim;
        for (int64_t d = 0; d < dim; ++d) one[d] = s * src[d];
        return static_cast<const float*>(one.data());
      };
      return call.Apply(p.keys.data(), p.size(), grad_of);
    };
    return WithRuleCall(pool, at, rule_name, hparam_names, slot_names, hyper, *version,
                        apply_pooled);
  });
}

// Checks that every entry of inverse[0..n) is in [-1, m).
ffi::Error CheckInverse(const int32_t* inv, int64_t n, int64_t m) {
  // The range in one pass without a branch; the first entry outside it is
  // looked for only to name it.
  int32_t lo = -1, hi = -1;
  for (int64_t j = 0; j < n; ++j) {
    lo = std::min(lo, inv[j]);
    hi = std::max(hi, inv[j]);
  }
  if (lo >= -1 && hi < m) return ffi::Error::Success();
  for (int64_t j = 0; j < n; ++j) {
    if (inv[j] < -1 || inv[j] >= m) {
      return Invalid("`inverse` must be in [-1, count = " + std::to_string(m) + "), got " +
                     std::to_string(inv[j]));
    }
  }
  return ffi::Error::Success();
}

// Rows m, m + 1, ... of the sums that take the shares of pruned ids.
constexpr int64_t kSpareRows = 4;

// D: dim when known at compile time (the common widths: whole vectors),
// else 0. The shares of the pruned ids (-1) go to kSpareRows rows after the
// m distinct ids' (in turn: no chain of adds to one row), so that no branch
// skips them (1-5 ids in a row pad unpredictably); the distinct ids' rows
// get the same terms in the same order as with the branch.
template <int D>
void SumDistinctFixed(const int32_t* inv, const float* w, const float* g, int64_t rows, int64_t len,
                      int64_t dim, int64_t m, Combiner comb, float* sums) {
  // A distinct id's sums are read and written at random: fetched kAhead
  // rows of ids ahead.
  constexpr int64_t kAhead = 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ir = inv + r * len;
    if (r + kAhead < rows) {
      for (int64_t j = 0; j < len; ++j) {
        const int32_t u = ir[kAhead * len + j];
        __builtin_prefetch(sums + (u >= 0 ? u : m) * dim, 1);
      }
    }
    float c = 1.0f;  // "sum": InverseDenominator is 1 whatever the weights
    if (comb != kSum) {
      float denom = 0;
      for (int64_t j = 0; j < len; ++j) {
        const float term = DenominatorTerm(PooledWeight(w, r * len + j, comb), comb);
        denom += ir[j] >= 0 ? term : 0.0f;  // + 0: the kept ids' sum, exactly
      }
      c = InverseDenominator(denom, comb);
    }
    const float* src = g + r * dim;
    for (int64_t j = 0; j < len; ++j) {
      const float s = PooledWeight(w, r * len + j, comb) * c;
      const int64_t u = ir[j] >= 0 ? ir[j] : m + (j % kSpareRows);
      AddScaled<D>(sums + u * dim, s, src, dim);
    }
  }
}

// Each id's share of its row's gradient g [rows, dim], w[r, k] /
// denominator(r) * g[r], summed per distinct id through inv [rows, len]
// (entries in [-1, m): CheckInverse) in batch order into *sums ([m, dim],
// and kSpareRows rows more).
void SumDistinct(const int32_t* inv, const float* w, const float* g, int64_t rows, int64_t len,
                 int64_t dim, int64_t m, Combiner comb, std::vector<float>* sums) {
  sums->assign((m + kSpareRows) * dim, 0.0f);
  float* out = sums->data();
  switch (dim) {
#define KRE_SUM_DISTINCT_CASE(D) \
  case D:                        \
    return SumDistinctFixed<D>(inv, w, g, rows, len, dim, m, comb, out);
    KRE_SUM_DISTINCT_CASE(4)
    KRE_SUM_DISTINCT_CASE(8)
    KRE_SUM_DISTINCT_CASE(16)
    KRE_SUM_DISTINCT_CASE(32)
    KRE_SUM_DISTINCT_CASE(64)
#undef KRE_SUM_DISTINCT_CASE
    default:
      return SumDistinctFixed<0>(inv, w, g, rows, len, dim, m, comb, out);
  }
}

// The backward of PooledLookupDistinct: id (r, k)'s share of row r's
// gradient, w[r, k] / denominator(r) * grads[r] (as ApplyPooled), summed
// per distinct id through `inverse` in batch order, then each distinct id
// updated once, shard by shard in first-seen order: the same sums, order
// and updates as ApplyPooled of the same ids.
ffi::Error ApplyDistinct(ffi::Token, ffi::AnyBuffer distinct, ffi::AnyBuffer count,
                         ffi::Buffer<ffi::S32, 2> inverse, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::F32, 2> grads, ffi::Buffer<ffi::F32> hyper,
                         ffi::AnyBuffer step, ffi::Result<ffi::Token>, int64_t table,
                         std::string_view rule_name, std::string_view hparam_names,
                         std::string_view slot_names, std::string_view combiner,
                         ffi::ThreadPool pool) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    if (ffi::Error e = CheckKeys(at, distinct); e.failure()) return e;
    auto comb = ParseCombinerAttr(combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = inverse.dimensions()[0], len = inverse.dimensions()[1], dim = at.dim();
    const auto wd = weights.dimensions();
    if (weights.element_count() != 0 && !(wd.size() == 2 && wd[0] == rows && wd[1] == len)) {
      return Invalid("`weights` must be empty or have the inverse's shape " +
                     Shape(inverse.dimensions()) + ", got " + Shape(wd));
    }
    if (ffi::Error e = CheckShape2(grads.dimensions(), "grads", rows, dim); e.failure()) return e;
    auto m = IntScalar(count, "count");
    if (m.has_error()) return m.error();
    if (*m < 0 || *m > static_cast<int64_t>(distinct.element_count())) {
      return Invalid("`count` must be in [0, " + std::to_string(distinct.element_count()) +
                     "], got " + std::to_string(*m));
    }
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const int32_t* inv = inverse.typed_data();
    if (ffi::Error e = CheckInverse(inv, rows * len, *m); e.failure()) return e;
    const float* w = OptionalWeights(weights);
    const float* g = grads.typed_data();
    auto apply_sums = [&](auto call) -> ffi::Error {
      using K = typename decltype(call)::Key;
      auto checked = call.Slots();
      if (checked.has_error()) return checked.error();
      const K* ids = distinct.reinterpret_data<K>();
      const rules::ApplyRow<typename decltype(call)::Rule> update(hyper.typed_data(), dim);
      auto sum_and_apply = [&table = call.table, rows, len, dim, comb = *comb, slot_ids = *checked,
                            step = call.step, update](const K* ids, int64_t m, const int32_t* inv,
                                                      const float* w, const float* g) {
        std::vector<float> sums;
        SumDistinct(inv, w, g, rows, len, dim, m, comb, &sums);
        const DistinctIds<K> d(table, ids, m, /*distinct=*/true);
        ApplyByShard(table, d.by_shard, sums.data(), slot_ids, step, update);
      };
      if (!Deferrable(pool)) {
        sum_and_apply(ids, *m, inv, w, g);
        return ffi::Error::Success();
      }
      // After the call returned (Defer): the work owns copies of the
      // operands it reads.
      Defer(pool, at,
            [sum_and_apply, ids = std::vector<K>(ids, ids + *m),
             inv = std::vector<int32_t>(inv, inv + rows * len),
             w = w == nullptr ? std::vector<float>() : std::vector<float>(w, w + rows * len),
             g = std::vector<float>(g, g + rows * dim)] {
              sum_and_apply(ids.data(), static_cast<int64_t>(ids.size()), inv.data(),
                            w.empty() ? nullptr : w.data(), g.data());
            });
      return ffi::Error::Success();
    };
    return WithRuleCall(pool, at, rule_name, hparam_names, slot_names, hyper, *version, apply_sums);
  });
}

}  // namespace

// The handlers' C symbols (extern "C": unmangled), which
// keras_rec_emb/_jax/ffi.py registers with jax.ffi.register_ffi_target.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableApply, Apply,
    (WithRuleAttrs(TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                                     ffi::AnyBuffer>>())
         .Attr<bool>("prune")
         .Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableApplyPooled, ApplyPooled,
    (WithRuleAttrs(TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::BufferR2<ffi::F32>,
                                     ffi::Buffer<ffi::F32>, ffi::AnyBuffer>>())
         .Attr<bool>("prune")
         .Attr<std::string_view>("combiner")
         .Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableApplyDistinct, ApplyDistinct,
    (WithRuleAttrs(TokenBinding<Args<ffi::AnyBuffer, ffi::AnyBuffer, ffi::BufferR2<ffi::S32>,
                                     ffi::Buffer<ffi::F32>, ffi::BufferR2<ffi::F32>,
                                     ffi::Buffer<ffi::F32>, ffi::AnyBuffer>>())
         .Attr<std::string_view>("combiner")
         .Ctx<ffi::ThreadPool>()));

#pragma GCC visibility pop

}  // namespace jaxbind
}  // namespace kre
