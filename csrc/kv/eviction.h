// Copyright keras_rec_emb authors. Apache-2.0.
//
// The eviction policies: GlobalStepEvict (a key whose last update is older
// than now - steps_to_live) and L2WeightEvict (DeepRec's rule: half the
// squared L2 norm of the row, tf.nn.l2_loss, below the threshold).
#ifndef KRE_KV_EVICTION_H_
#define KRE_KV_EVICTION_H_

#include <cstdint>

#include "kv/shard_ops.h"

namespace kre {
namespace kv {

class EvictionPolicy {
 public:
  // steps_to_live < 0 or no metadata: no step rule; l2_threshold < 0: no
  // L2 rule.
  EvictionPolicy(int64_t now, int64_t steps_to_live, float l2_threshold, bool have_meta)
      : now_(now),
        steps_to_live_(steps_to_live),
        l2_(l2_threshold),
        by_step_(steps_to_live >= 0 && have_meta) {}

  bool needs_values() const { return l2_ >= 0; }
  // By the version (last update or, not admitted, last sighting).
  bool StaleVersion(const int64_t* meta_version) const {
    return by_step_ && SatSub(now_, *meta_version) > steps_to_live_;
  }
  bool SmallWeight(const float* v, int64_t dim) const {
    if (l2_ < 0) return false;
    double sq = 0;
    for (int64_t d = 0; d < dim; ++d) sq += static_cast<double>(v[d]) * v[d];
    return 0.5 * sq < static_cast<double>(l2_);
  }

 private:
  int64_t now_;
  int64_t steps_to_live_;
  float l2_;
  bool by_step_;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_EVICTION_H_
