// Copyright keras_rec_emb authors. Apache-2.0.
//
// The key hash and how its 64 bits are used. One hash per key, computed
// once per batch (Partition) and handed to every table operation:
//
//   bits  0..23+  slot: the home slot in a shard's index is (h & mask)
//                 (mask = capacity - 1; low bits, as many as the capacity
//                 needs)
//   bits 24..55   shard: ((h >> 24) & 0xFFFFFFFF) * num_shards >> 32, any
//                 shard count
//   bits 56..63   not used by the index (it compares keys in the entries)
//
// The counting Bloom filter re-mixes h (bloom_filter.cc) and does not use
// these bits directly.
#ifndef KRE_KV_HASH_H_
#define KRE_KV_HASH_H_

#include <cstdint>

// Forces inlining of the per-key helpers of the lookup loops (GCC keeps
// some of them out of line otherwise, a call per key).
#define KRE_KV_INLINE inline __attribute__((always_inline))

namespace kre {
namespace kv {

// splitmix64 finalizer: a strong, cheap mix so that sequential ids spread.
inline uint64_t HashKey(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline int ShardOfHash(uint64_t h, uint64_t num_shards) {
  return static_cast<int>((((h >> 24) & 0xFFFFFFFFULL) * num_shards) >> 32);
}

// For static_asserts on sizes that index with `& (n - 1)`.
constexpr bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

// Maps a well-mixed 64-bit value to [0, n) with a multiply instead of a
// division (Lemire's fast range reduction).
inline uint64_t Reduce(uint64_t x, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * n) >> 64);
}

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_HASH_H_
