// Copyright keras_rec_emb authors. Apache-2.0.
//
// The admission rule of both filters (DeepRec's feature filter). The
// counter filter counts a key's sightings in its metadata row (the key has
// an index entry but no value row until admitted); the counting Bloom
// filter (bloom_filter.h) counts them outside the index. Either way a key is
// admitted once its count reaches `filter_freq`, and, as in DeepRec, the
// training lookup that admits it still reads no_permission_value (its row
// exists from then on, so this step's gradient trains it).
#ifndef KRE_KV_COUNTER_FILTER_H_
#define KRE_KV_COUNTER_FILTER_H_

#include <cstdint>

namespace kre {
namespace kv {

class CounterFilter {
 public:
  CounterFilter(int64_t filter_freq, bool counts_in_meta)
      : threshold_(filter_freq), counts_in_meta_(counts_in_meta && filter_freq > 1) {}

  // Whether keys enter the index before admission (the counter filter).
  bool counts_in_meta() const { return counts_in_meta_; }
  int64_t threshold() const { return threshold_; }
  // Whether any filter gates admission.
  bool gates() const { return threshold_ > 1; }
  // Whether a key counted `freq` times is admitted.
  bool Admits(int64_t freq) const { return freq >= threshold_; }

 private:
  int64_t threshold_;
  bool counts_in_meta_;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_COUNTER_FILTER_H_
