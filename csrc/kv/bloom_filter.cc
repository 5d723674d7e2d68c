// Copyright keras_rec_emb authors. Apache-2.0.
#include "kv/bloom_filter.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kv/hash.h"

namespace kre {
namespace kv {

void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes) {
  const double ln2 = std::log(2.0);
  const double m = std::ceil(-static_cast<double>(n) * std::log(p) / (ln2 * ln2));
  *counters = static_cast<uint64_t>(std::max(1.0, m));
  *hashes = std::max(1, static_cast<int>(std::lround(m / static_cast<double>(n) * ln2)));
}

namespace {

// Counters read and incremented atomically (relaxed: a counter is an
// estimate; shards that share one race only on the count, which the
// compare-exchange keeps exact).
template <typename C>
uint64_t LoadCounter(const uint8_t* base, uint64_t i) {
  return __atomic_load_n(reinterpret_cast<const C*>(base) + i, __ATOMIC_RELAXED);
}

template <typename C>
void IncrementCounter(uint8_t* base, uint64_t i) {
  C* c = reinterpret_cast<C*>(base) + i;
  C v = __atomic_load_n(c, __ATOMIC_RELAXED);
  while (v != static_cast<C>(~C{0}) &&  // saturated counters stay
         !__atomic_compare_exchange_n(c, &v, static_cast<C>(v + 1), /*weak=*/true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
}

uint64_t GetCounter(const uint8_t* base, uint64_t i, int bytes) {
  switch (bytes) {
    case 1:
      return LoadCounter<uint8_t>(base, i);
    case 2:
      return LoadCounter<uint16_t>(base, i);
    case 4:
      return LoadCounter<uint32_t>(base, i);
    default:
      return LoadCounter<uint64_t>(base, i);
  }
}

void BumpCounter(uint8_t* base, uint64_t i, int bytes) {
  switch (bytes) {
    case 1:
      return IncrementCounter<uint8_t>(base, i);
    case 2:
      return IncrementCounter<uint16_t>(base, i);
    case 4:
      return IncrementCounter<uint32_t>(base, i);
    default:
      return IncrementCounter<uint64_t>(base, i);
  }
}

// Appended to the saved counters: tells this layout (one filter for the
// table) from the per-shard layout of earlier versions, which cannot be
// mapped to it and is not restored.
constexpr char kBloomMagic[8] = {'K', 'R', 'E', 'C', 'B', 'F', '2', '\0'};

}  // namespace

CountingBloomFilter::CountingBloomFilter(uint64_t counters, int hashes, int counter_bytes)
    : counters_(counters), hashes_(hashes), bytes_(counter_bytes) {
  if (counters_ == 0) return;
  if (bytes_ != 1 && bytes_ != 2 && bytes_ != 4 && bytes_ != 8) {
    throw std::invalid_argument("bloom_counter_bytes must be 1, 2, 4 or 8");
  }
  if (hashes_ < 1) throw std::invalid_argument("bloom_hashes must be >= 1");
  words_.assign((counters_ * bytes_ + 7) / 8, 0);
}

uint64_t CountingBloomFilter::Slot(uint64_t h, int k) const {
  // Double hashing over two re-mixed hashes (h's own middle bits select the
  // shard), reduced to the filter's range by a multiply. The filter is one
  // for the table: a key's k positions range over all m counters whatever
  // the shard count, so the false-positive rate is the one it was sized
  // for.
  const uint64_t base = HashKey(h ^ 0x9e3779b97f4a7c15ULL);
  // (Not HashKey(h): for h = 0 that is 0, a step of 1 that the multiply
  // maps every position onto one counter.)
  const uint64_t step = HashKey(h ^ 0x632be59bd9b4e019ULL) | 1;
  return Reduce(base + static_cast<uint64_t>(k) * step, counters_);
}

uint64_t CountingBloomFilter::Count(uint64_t h) const {
  if (!enabled()) return 0;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(words_.data());
  uint64_t least = UINT64_MAX;
  for (int k = 0; k < hashes_; ++k) least = std::min(least, GetCounter(base, Slot(h, k), bytes_));
  return least;
}

uint64_t CountingBloomFilter::Add(uint64_t h) {
  uint8_t* base = reinterpret_cast<uint8_t*>(words_.data());
  // Each distinct position once per sighting: in a small filter two of a
  // key's k positions may coincide, and counting that counter twice would
  // let a key pass the threshold on fewer sightings than it has.
  uint64_t small[64];
  std::vector<uint64_t> large;
  uint64_t* pos = small;
  if (hashes_ > 64) {
    large.resize(hashes_);
    pos = large.data();
  }
  int distinct = 0;
  for (int k = 0; k < hashes_; ++k) {
    const uint64_t i = Slot(h, k);
    bool seen = false;
    for (int j = 0; j < distinct && !seen; ++j) seen = pos[j] == i;
    if (!seen) pos[distinct++] = i;
  }
  for (int j = 0; j < distinct; ++j) BumpCounter(base, pos[j], bytes_);
  return Count(h);
}

size_t CountingBloomFilter::StateBytes() const {
  return enabled() ? counters_ * bytes_ + sizeof(kBloomMagic) : 0;
}

std::vector<uint8_t> CountingBloomFilter::State() const {
  if (!enabled()) return {};
  const size_t bytes = counters_ * bytes_;
  std::vector<uint8_t> state(bytes + sizeof(kBloomMagic));
  std::memcpy(state.data(), words_.data(), bytes);
  std::memcpy(state.data() + bytes, kBloomMagic, sizeof(kBloomMagic));
  return state;
}

bool CountingBloomFilter::SetState(const std::vector<uint8_t>& state) {
  if (!enabled()) return false;
  const size_t bytes = counters_ * bytes_;
  if (state.size() != bytes + sizeof(kBloomMagic) ||
      std::memcmp(state.data() + bytes, kBloomMagic, sizeof(kBloomMagic)) != 0) {
    return false;
  }
  std::memcpy(words_.data(), state.data(), bytes);
  return true;
}

void CountingBloomFilter::Clear() { std::fill(words_.begin(), words_.end(), 0); }

}  // namespace kv
}  // namespace kre
