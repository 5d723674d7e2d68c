// Copyright keras_rec_emb authors. Apache-2.0.
//
// The counting Bloom filter of CBFFilter: one filter for the whole table
// (sized for the table, not split over shards), counters of 1, 2, 4 or 8
// bytes updated atomically so that shards share it without a lock, and
// saturating. A key's count is the smallest of its k counters.
#ifndef KRE_KV_BLOOM_FILTER_H_
#define KRE_KV_BLOOM_FILTER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kre {
namespace kv {

// Counting Bloom filter parameters for n expected keys and false-positive
// probability p: m = ceil(-n ln p / ln(2)^2) counters, k = round(m/n ln 2).
void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes);

class CountingBloomFilter {
 public:
  CountingBloomFilter() = default;
  // counters == 0: no filter. Throws std::invalid_argument for bad sizes.
  CountingBloomFilter(uint64_t counters, int hashes, int counter_bytes);

  bool enabled() const { return counters_ > 0; }
  // Adds one sighting of hash h; returns the estimated count afterwards.
  uint64_t Add(uint64_t h);
  // The estimated count of hash h.
  uint64_t Count(uint64_t h) const;
  // The counters followed by a format marker (empty without a filter).
  // Callers keep writers out (the table locks its shards).
  std::vector<uint8_t> State() const;
  // Restores State() output of a filter of this size; returns whether it did.
  bool SetState(const std::vector<uint8_t>& state);
  size_t StateBytes() const;
  void Clear();
  uint64_t MemoryBytes() const { return words_.capacity() * sizeof(uint64_t); }
  // Exchanges counters with a filter of the same size.
  void SwapCounters(CountingBloomFilter& o) { words_.swap(o.words_); }
  bool SameShape(const CountingBloomFilter& o) const {
    return words_.size() == o.words_.size() && bytes_ == o.bytes_;
  }

 private:
  uint64_t Slot(uint64_t h, int k) const;

  uint64_t counters_ = 0;
  int hashes_ = 0;
  int bytes_ = 8;
  // counters_ * bytes_ bytes, in 8-byte words so that every counter is
  // naturally aligned for atomics.
  std::vector<uint64_t> words_;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_BLOOM_FILTER_H_
