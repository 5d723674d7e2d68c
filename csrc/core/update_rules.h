// Copyright keras_rec_emb authors. Apache-2.0.
// The update rules of the fused sparse apply, free of TensorFlow: the TF
// kernel (csrc/kernels/apply_kernels.cc) and the XLA FFI binding (csrc/jax/) both apply
// rows with these, so that one model trains to the same tables under either
// Keras backend. Each rule follows the formulas of Keras's own optimizers
// (keras/src/optimizers/*.py) row by row.
//
// hyper[0] is the learning rate and hyper[1] the decoupled weight decay
// factor (weight_decay * learning_rate, applied to touched rows first, as
// Keras applies it before update_step: see ApplyRow). The rest is per rule.
//
// Each rule names its hyper-parameters (kHyperNames, the layout of `hyper`)
// and slots (kSlotNames; kExtraSlot, if any, is passed only when
// NeedsExtraSlot). keras_rec_emb/_update_rules.py declares the same names
// and the bindings receive them: CheckNames compares them, so a reordered or
// renamed list fails with InvalidArgument instead of training wrong.
//
// A rule declares its slots' widths in kSlotWidths: 0 for a full row (dim
// floats), 1 for one float per row. The extra slot is a full row.
#ifndef KRE_CORE_UPDATE_RULES_H_
#define KRE_CORE_UPDATE_RULES_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kv/shard_ops.h"

namespace kre {
namespace rules {

// What most rules share: no slot beyond kSlotNames (Adam overrides both).
struct RuleDefaults {
  static bool NeedsExtraSlot(const float*) { return false; }
  static constexpr const char* kExtraSlot = nullptr;
};

struct Sgd : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(no slots)";
  static constexpr int kHyper = 2;
  static constexpr int kSlots = 0;
  static constexpr int kSlotWidths[1] = {0};
  static constexpr const char* kHyperNames[kHyper] = {"learning_rate", "decay"};
  static constexpr const char* kSlotNames[1] = {nullptr};
  float lr;
  explicit Sgd(const float* h) : lr(h[0]) {}
  void operator()(float* var, float**, const float* g, int64_t dim) const {
    for (int64_t d = 0; d < dim; ++d) var[d] -= g[d] * lr;
  }
};

struct Momentum : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(momentum)";
  static constexpr int kHyper = 4;
  static constexpr int kSlots = 1;  // momentum
  static constexpr int kSlotWidths[1] = {0};
  static constexpr const char* kHyperNames[kHyper] = {"learning_rate", "decay", "momentum",
                                                      "nesterov"};
  static constexpr const char* kSlotNames[1] = {"momentum"};
  float lr, momentum;
  bool nesterov;
  explicit Momentum(const float* h) : lr(h[0]), momentum(h[2]), nesterov(h[3] != 0.0f) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* m = slots[0];
    for (int64_t d = 0; d < dim; ++d) {
      m[d] = m[d] * momentum - g[d] * lr;
      var[d] += nesterov ? m[d] * momentum - g[d] * lr : m[d];
    }
  }
};

struct Adagrad : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(accumulator)";
  static constexpr int kHyper = 3;
  static constexpr int kSlots = 1;  // accumulator
  static constexpr int kSlotWidths[1] = {0};
  static constexpr const char* kHyperNames[kHyper] = {"learning_rate", "decay", "epsilon"};
  static constexpr const char* kSlotNames[1] = {"accumulator"};
  float lr, epsilon;
  explicit Adagrad(const float* h) : lr(h[0]), epsilon(h[2]) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* acc = slots[0];
    int64_t d = 0;
    // Four lanes at a time: the same operations in the same order, each
    // correctly rounded (SSE sqrt and div), so the same bits as the loop.
    const __m128 lr4 = _mm_set1_ps(lr), eps4 = _mm_set1_ps(epsilon);
    for (; d + 4 <= dim; d += 4) {
      const __m128 g4 = _mm_loadu_ps(g + d);
      const __m128 a4 = _mm_add_ps(_mm_loadu_ps(acc + d), _mm_mul_ps(g4, g4));
      _mm_storeu_ps(acc + d, a4);
      const __m128 step = _mm_div_ps(_mm_mul_ps(lr4, g4), _mm_sqrt_ps(_mm_add_ps(a4, eps4)));
      _mm_storeu_ps(var + d, _mm_sub_ps(_mm_loadu_ps(var + d), step));
    }
    for (; d < dim; ++d) {
      acc[d] += g[d] * g[d];
      var[d] -= (lr * g[d]) / std::sqrt(acc[d] + epsilon);
    }
  }
};

struct Adam : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(momentum, velocity, and with amsgrad velocity_hat)";
  // With amsgrad (hyper[6] != 0) a third slot, velocity_hat.
  static bool NeedsExtraSlot(const float* h) { return h[6] != 0.0f; }
  static constexpr int kHyper = 7;
  static constexpr int kSlots = 2;  // momentum, velocity (+ velocity_hat)
  static constexpr int kSlotWidths[2] = {0, 0};
  static constexpr const char* kHyperNames[kHyper] = {
      "learning_rate", "decay", "alpha", "beta_1", "beta_2", "epsilon", "amsgrad"};
  static constexpr const char* kSlotNames[2] = {"momentum", "velocity"};
  static constexpr const char* kExtraSlot = "velocity_hat";
  float alpha, beta1, beta2, epsilon;
  bool amsgrad;
  explicit Adam(const float* h)
      : alpha(h[2]), beta1(h[3]), beta2(h[4]), epsilon(h[5]), amsgrad(h[6] != 0.0f) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* m = slots[0];
    float* v = slots[1];
    for (int64_t d = 0; d < dim; ++d) {
      m[d] += (g[d] - m[d]) * (1.0f - beta1);
      v[d] += (g[d] * g[d] - v[d]) * (1.0f - beta2);
      float vv = v[d];
      if (amsgrad) {
        slots[2][d] = std::max(slots[2][d], v[d]);
        vv = slots[2][d];
      }
      var[d] -= (m[d] * alpha) / (std::sqrt(vv) + epsilon);
    }
  }
};

struct Ftrl : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(accumulator, linear)";
  static constexpr int kHyper = 6;
  static constexpr int kSlots = 2;  // accumulator, linear
  static constexpr int kSlotWidths[2] = {0, 0};
  static constexpr const char* kHyperNames[kHyper] = {
      "learning_rate", "decay", "learning_rate_power", "l1", "l2_plus_beta", "l2_shrinkage"};
  static constexpr const char* kSlotNames[2] = {"accumulator", "linear"};
  float lr, lr_power, l1, l2, l2_shrinkage;
  // hyper: lr, decay, lr_power, l1, l2 + beta / (2 lr), l2_shrinkage
  explicit Ftrl(const float* h)
      : lr(h[0]), lr_power(h[2]), l1(h[3]), l2(h[4]), l2_shrinkage(h[5]) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* accum = slots[0];
    float* linear = slots[1];
    for (int64_t d = 0; d < dim; ++d) {
      const float grad_to_use = g[d] + 2.0f * l2_shrinkage * var[d];
      const float new_accum = accum[d] + g[d] * g[d];
      const float new_pow = std::pow(new_accum, -lr_power);
      linear[d] += grad_to_use - (new_pow - std::pow(accum[d], -lr_power)) / lr * var[d];
      const float quadratic = new_pow / lr + 2.0f * l2;
      const float clipped = std::min(std::max(linear[d], -l1), l1);
      var[d] = (clipped - linear[d]) / quadratic;
      accum[d] = new_accum;
    }
  }
};

// DeepRec's FTRL for EmbeddingVariables (KvSparseApplyFtrl): the L1/L2
// shrinkage acts on the row as a group. With the row's `linear` norm |z|,
// the row is 0 when |z| <= l1, otherwise
// row = (l1 - |z|) / ((accum_new**-lr_power / lr + 2 l2) * |z|) * z
// (element-wise accumulators). As in DeepRec, with l2_shrinkage the new
// accumulator adds the square of the shrunk gradient for `linear` but the
// stored one adds the plain gradient's square. hyper as for "ftrl".
struct FtrlGroup : Ftrl {
  using Ftrl::Ftrl;
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* accum = slots[0];
    float* linear = slots[1];
    double norm_sq = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const float grad_to_use = g[d] + 2.0f * l2_shrinkage * var[d];
      const float new_accum = accum[d] + grad_to_use * grad_to_use;
      linear[d] += grad_to_use -
                   (std::pow(new_accum, -lr_power) - std::pow(accum[d], -lr_power)) / lr * var[d];
      norm_sq += static_cast<double>(linear[d]) * linear[d];
    }
    const float norm = static_cast<float>(std::sqrt(norm_sq));
    for (int64_t d = 0; d < dim; ++d) {
      if (norm > l1) {
        const float grad_to_use = g[d] + 2.0f * l2_shrinkage * var[d];
        const float new_accum = accum[d] + grad_to_use * grad_to_use;
        const float eta_rec = std::pow(new_accum, -lr_power) / lr;
        var[d] = (l1 - norm) / ((eta_rec + 2.0f * l2) * norm) * linear[d];
      } else {
        var[d] = 0.0f;
      }
      accum[d] += g[d] * g[d];
    }
  }
};

// DeepRec's AdamAsync with bias-correction powers per row, so that a row's
// correction follows its own number of updates. hyper: lr, decay, beta1,
// beta2, epsilon, use_nesterov, apply_sparse_rmsprop.
struct AdamAsync : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(momentum, velocity, beta1_power, beta2_power)";
  static constexpr int kHyper = 7;
  static constexpr int kSlots = 4;  // momentum, velocity, beta1_power, beta2_power
  static constexpr int kSlotWidths[4] = {0, 0, 1, 1};
  static constexpr const char* kHyperNames[kHyper] = {
      "learning_rate",       "decay", "beta_1", "beta_2", "epsilon", "use_nesterov",
      "apply_sparse_rmsprop"};
  static constexpr const char* kSlotNames[4] = {"momentum", "velocity", "beta1_power",
                                                "beta2_power"};
  float lr, beta1, beta2, epsilon;
  bool nesterov, rmsprop;
  explicit AdamAsync(const float* h)
      : lr(h[0]),
        beta1(h[2]),
        beta2(h[3]),
        epsilon(h[4]),
        nesterov(h[5] != 0.0f),
        rmsprop(h[6] != 0.0f) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* m = slots[0];
    float* v = slots[1];
    if (rmsprop) {  // RMSProp on the row; the powers stay as they are
      for (int64_t d = 0; d < dim; ++d) {
        v[d] = v[d] * beta2 + g[d] * g[d] * (1.0f - beta2);
        m[d] = m[d] * beta1 + lr * g[d] / std::sqrt(v[d] + epsilon);
        var[d] -= m[d];
      }
      return;
    }
    float& beta1_power = slots[2][0];
    float& beta2_power = slots[3][0];
    const float alpha = lr * std::sqrt(1.0f - beta2_power) / (1.0f - beta1_power);
    for (int64_t d = 0; d < dim; ++d) {
      m[d] = m[d] * beta1 + g[d] * (1.0f - beta1);
      v[d] = v[d] * beta2 + g[d] * g[d] * (1.0f - beta2);
      const float step = nesterov ? g[d] * (1.0f - beta1) + beta1 * m[d] : m[d];
      var[d] -= step * alpha / (std::sqrt(v[d]) + epsilon);
    }
    beta1_power *= beta1;
    beta2_power *= beta2;
  }
};

// DeepRec's AdagradDecay (KvSparseApplyAdagradDecay): `period` is
// (global_step + 1) // accumulator_decay_step; a row whose decay count
// (slot `decay_period`, DeepRec's accumulator_decay_power) is below it has
// its accumulator multiplied by `rate` once, floored at `baseline`, and its
// count raised by one: at most one decay per update of the row, however
// many periods it missed. hyper: lr, decay, epsilon, rate, baseline, period
// (as a float).
struct AdagradDecay : RuleDefaults {
  static constexpr const char* kSlotsDoc = "(accumulator, decay_period)";
  static constexpr int kHyper = 6;
  static constexpr int kSlots = 2;  // accumulator, decay_period
  static constexpr int kSlotWidths[2] = {0, 1};
  static constexpr const char* kHyperNames[kHyper] = {"learning_rate", "decay",    "epsilon",
                                                      "decay_rate",    "baseline", "period"};
  static constexpr const char* kSlotNames[2] = {"accumulator", "decay_period"};
  float lr, epsilon, rate, baseline, period;
  explicit AdagradDecay(const float* h)
      : lr(h[0]), epsilon(h[2]), rate(h[3]), baseline(h[4]), period(h[5]) {}
  void operator()(float* var, float** slots, const float* g, int64_t dim) const {
    float* acc = slots[0];
    float& row_period = slots[1][0];
    if (period > row_period) {
      for (int64_t d = 0; d < dim; ++d) acc[d] = std::max(acc[d] * rate, baseline);
      row_period += 1.0f;
    }
    for (int64_t d = 0; d < dim; ++d) {
      acc[d] += g[d] * g[d];
      var[d] -= lr * g[d] / std::sqrt(acc[d] + epsilon);
    }
  }
};

// The distinct keys of a shard's part of a batch, in first-seen order, with
// their gradient rows summed (row order[i] of `sums` is key i's).
template <typename K>
struct DistinctRows {
  DistinctRows(int64_t n, int64_t dim) : dim(dim), groups(n) {
    keys.reserve(n);
    hashes.reserve(n);
    sums.reserve(n * dim);
  }
  void Add(K key, uint64_t hash, const float* grad) {
    bool created;
    const int64_t i =
        groups.Group(hash, [&](int64_t other) { return keys[other] == key; }, &created);
    if (created) {
      keys.push_back(key);
      hashes.push_back(hash);
      order.push_back(i);
      sums.insert(sums.end(), grad, grad + dim);
    } else {
      float* acc = sums.data() + i * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += grad[d];
    }
  }
  int64_t size() const { return static_cast<int64_t>(keys.size()); }

  const int64_t dim;
  kv::BatchGroups groups;
  std::vector<K> keys;
  std::vector<uint64_t> hashes;
  std::vector<int64_t> order;
  std::vector<float> sums;
};

template <typename Rule>
struct RuleTag {
  using type = Rule;
};

// Calls `visit(RuleTag<Rule>())` for the rule named `rule`; false if none is.
template <typename Visit>
bool WithRule(const std::string& rule, Visit&& visit) {
  if (rule == "sgd") return visit(RuleTag<Sgd>()), true;
  if (rule == "momentum") return visit(RuleTag<Momentum>()), true;
  if (rule == "adagrad") return visit(RuleTag<Adagrad>()), true;
  if (rule == "adam") return visit(RuleTag<Adam>()), true;
  if (rule == "ftrl") return visit(RuleTag<Ftrl>()), true;
  if (rule == "ftrl_group") return visit(RuleTag<FtrlGroup>()), true;
  if (rule == "adam_async") return visit(RuleTag<AdamAsync>()), true;
  if (rule == "adagrad_decay") return visit(RuleTag<AdagradDecay>()), true;
  return false;
}

// The slot width rule `Rule` needs for slot j of a table with rows of `dim`.
template <typename Rule>
int64_t SlotWidth(size_t j, int64_t dim) {
  return static_cast<int>(j) < Rule::kSlots && Rule::kSlotWidths[j] == 1 ? 1 : dim;
}

inline std::string Joined(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out + "]";
}

// The hyper-parameter and slot names a binding received for rule `rule`
// against the rule's own (see the top): empty when they match, else the
// message of an InvalidArgument.
template <typename Rule>
std::string CheckNames(const std::string& rule, const std::vector<std::string>& hparams,
                       const std::vector<std::string>& slots) {
  const std::vector<std::string> want_h(Rule::kHyperNames, Rule::kHyperNames + Rule::kHyper);
  if (hparams != want_h) {
    return "rule '" + rule + "' takes hyper-parameters " + Joined(want_h) +
           " in this order; the op received " + Joined(hparams);
  }
  std::vector<std::string> want_s(Rule::kSlotNames, Rule::kSlotNames + Rule::kSlots);
  const bool extra =
      Rule::kExtraSlot != nullptr && slots.size() == static_cast<size_t>(Rule::kSlots) + 1;
  if (extra) want_s.push_back(Rule::kExtraSlot);
  if (slots != want_s) {
    std::string allowed = Joined(want_s);
    if (Rule::kExtraSlot != nullptr && !extra) {
      allowed += std::string(" (plus ") + Rule::kExtraSlot + ")";
    }
    return "rule '" + rule + "' takes slots " + allowed + " in this order; the op received " +
           Joined(slots);
  }
  return "";
}

// One row's update: the decoupled weight decay (hyper[1]), then the rule.
template <typename Rule>
struct ApplyRow {
  ApplyRow(const float* hyper, int64_t dim) : rule(hyper), decay(hyper[1]), dim(dim) {}
  void operator()(float* var, float** slots, const float* grad) const {
    if (decay != 0.0f) {
      for (int64_t d = 0; d < dim; ++d) var[d] -= var[d] * decay;
    }
    rule(var, slots, grad, dim);
  }
  const Rule rule;
  const float decay;
  const int64_t dim;
};

}  // namespace rules
}  // namespace kre

#endif  // KRE_CORE_UPDATE_RULES_H_
