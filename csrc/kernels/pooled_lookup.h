// Copyright keras_rec_emb authors. Apache-2.0.
// The pooled path of the lookup kernels: one feature's kept ids, in batch
// order and not deduplicated, looked up and combined straight into the
// output, block by block. Serves the group lookup's pooled features
// (group_forward.cc) and every feature of the stacked pooled lookup
// (stacked_lookup_kernels.cc).
//
// A table that reads in batch order (kv::Table::PrefersOrderedLookup: rows
// in DRAM, no admission filter, not too large) has each block's rows found
// with kv::Table::OrderedReader (row pointers, prefetched) and combined from
// the table by CombinePooledRows. Any other table (a filter, a file tier, a
// large table) has a chunk of ids grouped by shard and looked up shard by
// shard into a row buffer (kv::Table::Lookup without insert), then combined
// alike. The outputs are bit-identical to the deduplicating path's for
// unweighted ids (see CombinePooledRows).
#ifndef KRE_KERNELS_POOLED_LOOKUP_H_
#define KRE_KERNELS_POOLED_LOOKUP_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels/pooled_combine.h"
#include "kernels/table_resource.h"
#include "kv/partition.h"
#include "kv/shard_ops.h"

namespace kre {

// Kept ids per block of a feature read in batch order: the block's ids stay
// in L1, its rows in L2.
constexpr int64_t kPooledBlockIds = 1024;
// Ids per chunk of a feature looked up shard by shard: enough per shard for
// each shard's lookup to stay within its own memory a while.
constexpr int64_t kPooledChunkIds = 1 << 16;
// Rows per unit of work at least, when a feature is split over threads.
constexpr int64_t kPooledMinUnitRows = 256;

// One feature on the pooled path.
struct PooledFeature {
  const int64_t* kept;    // its kept ids (ids to look up), row after row
  const int64_t* splits;  // row b's ids: kept[splits[b] .. splits[b + 1])
  int64_t dim;
  int64_t default_id;  // >= 0: read by an empty row (else zeros)
  Combiner combiner;
  float* out;  // row b's output at out + b * stride
  int64_t stride;
  int feature, table;  // for messages
};

// How many units a pooled feature of `rows` rows is split into, with F
// features in all on `threads` threads: two units a thread in all, none
// under kPooledMinUnitRows rows.
inline int64_t PooledRanges(int threads, int64_t features, int64_t rows) {
  return std::max<int64_t>(
      1, std::min<int64_t>((2 * threads + features - 1) / std::max<int64_t>(features, 1),
                           rows / kPooledMinUnitRows));
}

// Rows of a buffer for a feature read shard by shard: a chunk holds
// kPooledChunkIds ids, or one row (with its default id) of max_len ids.
inline int64_t PooledBufferRows(int64_t kept, int64_t rows, int64_t max_len) {
  return std::min(kept + rows, std::max(kPooledChunkIds, max_len) + 1);
}

namespace pooled_internal {

// Scratch of a block of one feature's rows, when its keys are not the kept
// ids as they are (an int32 table, or rows filled with the default id).
template <typename K>
struct Block {
  std::vector<K> keys;
  std::vector<int64_t> splits;
  std::vector<const float*> rows;  // the rows found, and the pad row
};

// The rows of in[0, n), shard by shard into `buffer` (room for n rows of dim
// floats); their pointers into rows[0, n).
template <typename K>
void FindByShard(kv::Table<K>& table, const K* in, int64_t n, int64_t dim, float* buffer,
                 const float** rows) {
  // One block: this runs on one of the op's units already.
  const kv::Partitioned<K> p = kv::Partition(table, in, n, 1, [](int num_blocks, auto&& fn) {
    for (int b = 0; b < num_blocks; ++b) fn(b);
  });
  for (int s = 0; s < table.num_shards(); ++s) {
    const int64_t b = p.offsets[s], m = p.offsets[s + 1] - b;
    if (m > 0) {
      table.Lookup(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, m,
                   /*insert=*/false, buffer);
    }
  }
  for (int64_t u = 0; u < n; ++u) rows[u] = buffer + u * dim;
}

}  // namespace pooled_internal

// Rows [begin, end) of feature `pf` from `table`: in blocks of about
// kPooledBlockIds ids read in batch order when `buffer` is null, else in
// chunks of kPooledChunkIds ids read shard by shard into `buffer` (rows of
// PooledBufferRows). An id that does not fit an int32 table's keys is
// InvalidArgument.
template <typename K>
absl::Status PooledRows(kv::Table<K>& table, const PooledFeature& pf, int64_t begin, int64_t end,
                        float* buffer) {
  thread_local pooled_internal::Block<K> blk;
  const int64_t* kept = pf.kept;
  const int64_t* splits = pf.splits;
  const int64_t def = pf.default_id;
  std::optional<typename kv::Table<K>::OrderedReader> reader;
  if (buffer == nullptr) reader.emplace(table);
  const int64_t max_ids = buffer == nullptr ? kPooledBlockIds : kPooledChunkIds;
  for (int64_t b0 = begin; b0 < end;) {
    // Rows [b0, b1): as many as hold max_ids keys (at least one row),
    // counting a default id for each row when empty rows may read one.
    const int64_t j0 = splits[b0];
    const int64_t per_row_fill = def >= 0 ? 1 : 0;
    int64_t b1 = b0 + 1;
    int64_t max_len = splits[b1] - j0, min_len = max_len;
    while (b1 < end && splits[b1 + 1] - j0 + per_row_fill * (b1 + 1 - b0) <= max_ids) {
      const int64_t n = splits[b1 + 1] - splits[b1];
      max_len = std::max(max_len, n);
      min_len = std::min(min_len, n);
      ++b1;
    }
    const int64_t rows = b1 - b0;
    int64_t n = splits[b1] - j0;
    // The block's keys: the kept ids where they are, or (an int32 table,
    // or an empty row to fill with the default id) a copy in blk.
    const K* keys;
    const int64_t* sp = splits;
    int64_t first = b0, base = j0;
    const bool fill = def >= 0 && min_len == 0;
    if (std::is_same_v<K, int64_t> && !fill) {
      keys = reinterpret_cast<const K*>(kept + j0);
    } else {
      blk.keys.resize(n + rows);
      blk.splits.resize(rows + 1);
      K* k = blk.keys.data();
      int64_t m = 0;
      blk.splits[0] = 0;
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
          if constexpr (!std::is_same_v<K, int64_t>) {
            if (kept[j] > std::numeric_limits<K>::max() ||
                kept[j] < std::numeric_limits<K>::min()) {
              return errors::InvalidArgument("id ", kept[j], " of feature ", pf.feature, " (row ",
                                             b, ") does not fit table ", pf.table, "'s int32 keys");
            }
          }
          k[m++] = static_cast<K>(kept[j]);
        }
        if (fill && splits[b + 1] == splits[b]) k[m++] = static_cast<K>(def);
        blk.splits[b - b0 + 1] = m;
      }
      if (fill) max_len = std::max<int64_t>(max_len, 1);
      n = m;
      keys = k;
      sp = blk.splits.data();
      first = 0;
      base = 0;
    }
    // One slot more: the pad row.
    if (static_cast<int64_t>(blk.rows.size()) < n + 1) blk.rows.resize(n + 1);
    if (reader) {
      reader->Find(keys, n, blk.rows.data(), /*read_later=*/true);
    } else {
      pooled_internal::FindByShard(table, keys, n, pf.dim, buffer, blk.rows.data());
    }
    blk.rows[n] = kNegativeZeros.data();
    CombinePooledRows(pf.dim, sp, base, first, first + rows, blk.rows.data(),
                      PadPooledRows(max_len, rows, n), n, max_len, pf.combiner,
                      pf.out + (b0 - first) * pf.stride, pf.stride);
    b0 = b1;
  }
  kv::StreamFence();  // the streamed stores are ordered before the op completes
  return absl::OkStatus();
}

// PooledRows on a table of either key dtype.
inline absl::Status PooledRows(const TableSlot& table, const PooledFeature& pf, int64_t begin,
                               int64_t end, float* buffer) {
  return table.t64 ? PooledRows(table.t64->table(), pf, begin, end, buffer)
                   : PooledRows(table.t32->table(), pf, begin, end, buffer);
}

}  // namespace kre

#endif  // KRE_KERNELS_POOLED_LOOKUP_H_
