// Copyright keras_rec_emb authors. Apache-2.0.
// The de-duplication of a batch's ids, without TensorFlow or XLA: the
// distinct ids in first-seen order, each with its key's hash and its number
// of occurrences (DistinctBuilder), grouped by shard (a counting sort into
// a kv::Partitioned: GroupByShard) for kv::Table::LookupCounted and
// ApplyDistinct, so that a training lookup reads each distinct id once,
// counted as often as it occurs. The TensorFlow group lookup (csrc/kernels/distinct_lookup.cc) and
// the JAX binding's pooled lookups and updates (csrc/jax/pooled_ids.h) both
// run it.
#ifndef KRE_CORE_DISTINCT_IDS_H_
#define KRE_CORE_DISTINCT_IDS_H_

#include <cstdint>
#include <vector>

#include "kv/partition.h"
#include "kv/shard_ops.h"
#include "kv/table.h"

namespace kre {

// Collects the distinct ids of up to n ids into *uniq (ids as U), their
// hashes into *hashes and their occurrences into *counts (all cleared
// first); Add returns an id's index among them.
template <typename U>
class DistinctBuilder {
 public:
  DistinctBuilder(int64_t n, std::vector<U>* uniq, std::vector<uint64_t>* hashes,
                  std::vector<int32_t>* counts)
      : groups_(n), uniq_(*uniq), hashes_(*hashes), counts_(*counts) {
    uniq_.clear();
    hashes_.clear();
    counts_.clear();
    uniq_.reserve(n);
    hashes_.reserve(n);
    counts_.reserve(n);
  }

  // Add of key_at(0), ..., key_at(n - 1) in order, each index written to
  // inverse[j]; hash(k) is key k's hash. Each hash is computed kAddAhead
  // ids before its Add and its home slot prefetched then
  // (kv::BatchGroups::Prefetch): the TensorFlow group's de-duplication
  // took about 1.25x less time so (docs/performance.md).
  template <typename KeyAt, typename HashFn>
  void AddAll(int64_t n, KeyAt&& key_at, HashFn&& hash, int32_t* inverse) {
    uint64_t ring[kAddAhead];
    const int64_t warm = n < kAddAhead ? n : kAddAhead;
    for (int64_t j = 0; j < warm; ++j) {
      ring[j] = hash(key_at(j));
      groups_.Prefetch(ring[j]);
    }
    for (int64_t j = 0; j < n; ++j) {
      const uint64_t h = ring[j & (kAddAhead - 1)];
      if (j + kAddAhead < n) {
        const uint64_t ahead = hash(key_at(j + kAddAhead));
        ring[j & (kAddAhead - 1)] = ahead;
        groups_.Prefetch(ahead);
      }
      inverse[j] = static_cast<int32_t>(Add(static_cast<U>(key_at(j)), h));
    }
  }

  // Counts id k (hash h) once more; its index among the distinct ids.
  int64_t Add(U k, uint64_t h) {
    bool created;
    const int64_t u = groups_.Group(h, [&](int64_t g) { return uniq_[g] == k; }, &created);
    if (created) {
      uniq_.push_back(k);
      hashes_.push_back(h);
      counts_.push_back(0);
    }
    ++counts_[u];
    return u;
  }

 private:
  static constexpr int64_t kAddAhead = 8;
  static_assert((kAddAhead & (kAddAhead - 1)) == 0, "ring slots are j & (kAddAhead - 1)");
  kv::BatchGroups groups_;
  std::vector<U>& uniq_;
  std::vector<uint64_t>& hashes_;
  std::vector<int32_t>& counts_;
};

// The distinct keys of a table grouped by shard are a kv::Partitioned (shard
// s holds keys[offsets[s], offsets[s + 1]), key j being distinct id
// order[j], with hash hashes[j]).
//
// Groups the n distinct ids uniq (their hashes in `uniq_hashes`) by shard
// of `table` into *p (a counting sort: each shard's keys in first-seen
// order).
template <typename K, typename U>
void GroupByShard(const kv::Table<K>& table, const U* uniq, const uint64_t* uniq_hashes, int64_t n,
                  kv::Partitioned<K>* p) {
  const int shards = table.num_shards();
  p->offsets.assign(shards + 1, 0);
  for (int64_t u = 0; u < n; ++u) ++p->offsets[table.ShardOf(uniq_hashes[u]) + 1];
  for (int s = 0; s < shards; ++s) p->offsets[s + 1] += p->offsets[s];
  std::vector<int64_t> next(p->offsets.begin(), p->offsets.end() - 1);
  p->keys.resize(n);
  p->hashes.resize(n);
  p->order.resize(n);
  for (int64_t u = 0; u < n; ++u) {
    const uint64_t h = uniq_hashes[u];
    const int64_t j = next[table.ShardOf(h)]++;
    p->keys[j] = static_cast<K>(uniq[u]);
    p->hashes[j] = h;
    p->order[j] = u;
  }
}

// Reads the rows of shard sh's distinct keys of p into rows ([distinct
// ids, dim], row u distinct id u's); with `insert` (training) each counts
// as often as `counts` (of the distinct ids) says.
template <typename K>
void LookupShardCounted(kv::Table<K>& table, const kv::Partitioned<K>& p, int sh,
                        const int32_t* counts, bool insert, float* rows) {
  const int64_t b = p.offsets[sh];
  const int64_t n = p.offsets[sh + 1] - b;
  if (n == 0) return;
  table.LookupCounted(sh, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, counts, n,
                      insert, rows);
}

// LookupShardCounted of every shard, one after the other.
template <typename K>
void LookupCountedByShard(kv::Table<K>& table, const kv::Partitioned<K>& p, const int32_t* counts,
                          bool insert, float* rows) {
  for (int s = 0; s < table.num_shards(); ++s) {
    LookupShardCounted(table, p, s, counts, insert, rows);
  }
}

// update's rule applied to each distinct key of p once, shard after shard:
// distinct id u's gradient is sums[u * dim, (u + 1) * dim).
template <typename K, typename Update>
void ApplyByShard(kv::Table<K>& table, const kv::Partitioned<K>& p, const float* sums,
                  const std::vector<int>& slot_ids, int64_t step, const Update& update) {
  for (int s = 0; s < table.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    if (p.offsets[s + 1] == b) continue;
    table.ApplyDistinct(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                        p.offsets[s + 1] - b, sums, slot_ids, step, update);
  }
}

}  // namespace kre

#endif  // KRE_CORE_DISTINCT_IDS_H_
