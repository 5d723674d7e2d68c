// Copyright keras_rec_emb authors. Apache-2.0.
//
// Groups a batch of keys by table shard (a stable counting sort), so that a
// batched table operation locks each shard once and reads its keys and
// hashes in order. The work is split into blocks that a caller-supplied
// parallel-for runs concurrently.
#ifndef KRE_KV_PARTITION_H_
#define KRE_KV_PARTITION_H_

#include <cstdint>
#include <vector>

#include "kv/table.h"

namespace kre {
namespace kv {

template <typename K>
struct Partitioned {
  // Entry j of shard s, for j in [offsets[s], offsets[s+1]): the key, its
  // hash, and its position in the batch (increasing within a shard).
  std::vector<K> keys;
  std::vector<uint64_t> hashes;
  std::vector<int64_t> order;
  std::vector<int64_t> offsets;
};

// `parallel_for(num_blocks, fn)` must call fn(b) for every b in
// [0, num_blocks), in any order and on any threads, and return when all done.
template <typename K, typename ParallelFor>
Partitioned<K> Partition(const Table<K>& table, const K* keys, int64_t n, int num_blocks,
                         ParallelFor&& parallel_for) {
  const int shards = table.num_shards();
  if (num_blocks < 1) num_blocks = 1;
  if (n < num_blocks) num_blocks = n > 0 ? static_cast<int>(n) : 1;
  Partitioned<K> p;
  p.keys.resize(n);
  p.hashes.resize(n);
  p.order.resize(n);
  p.offsets.assign(shards + 1, 0);
  std::vector<int64_t> counts(static_cast<size_t>(num_blocks) * shards, 0);
  auto block_begin = [&](int b) { return n * b / num_blocks; };

  parallel_for(num_blocks, [&](int b) {
    int64_t* c = counts.data() + static_cast<size_t>(b) * shards;
    for (int64_t i = block_begin(b); i < block_begin(b + 1); ++i) {
      ++c[table.ShardOf(Table<K>::Hash(keys[i]))];
    }
  });
  // Block b's first position in shard s: all of shard < s, then blocks < b.
  int64_t running = 0;
  for (int s = 0; s < shards; ++s) {
    p.offsets[s] = running;
    for (int b = 0; b < num_blocks; ++b) {
      int64_t& c = counts[static_cast<size_t>(b) * shards + s];
      const int64_t count = c;
      c = running;
      running += count;
    }
  }
  p.offsets[shards] = running;
  parallel_for(num_blocks, [&](int b) {
    int64_t* next = counts.data() + static_cast<size_t>(b) * shards;
    for (int64_t i = block_begin(b); i < block_begin(b + 1); ++i) {
      const uint64_t h = Table<K>::Hash(keys[i]);  // cheaper than storing it
      const int64_t j = next[table.ShardOf(h)]++;
      p.keys[j] = keys[i];
      p.hashes[j] = h;
      p.order[j] = i;
    }
  });
  return p;
}

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_PARTITION_H_
