// Copyright keras_rec_emb authors. Apache-2.0.
// Kernel of KRE>StackedPooledLookup (csrc/ops/stack_ops.cc): the inference
// lookup of the ids of F features stacked in one [batch, F, L] tensor.
//
// One pass over the ids splits them into each feature's kept ids and row
// splits (KeepRows, as KRE>UnstackKeptIds does: the input read once in
// order). Then feature by feature, in blocks of about kBlockIds ids, each
// block's rows are found in the table with kv::Table::OrderedReader (row
// pointers, prefetched) and combined straight from the table into the
// output by CombinePooledRows, as the group lookup's lean pooled path does
// after KRE>UnstackKeptIds, but without the op boundary between them and
// what the group lookup's other paths need of it (its per-feature checks of
// ids and splits, copies of the splits, unique_ids and inverse outputs).
// Reading each feature's ids straight from the stacked tensor instead
// measured slower: a feature's ids lie F * L apart, and those strided loads
// missed for about a third of the op's time, prefetched or not.
// A table that does not read in batch order (a filter or a file tier:
// kv::Table::OrderedLookups; or too large: PrefersOrderedLookup) has its
// feature's ids looked up in chunks, grouped by shard and looked up shard by
// shard into a row buffer, then combined alike. Outputs are bit-identical to
// the group lookup's.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/keep_rows.h"
#include "kernels/pooled_combine.h"
#include "kernels/table_resource.h"
#include "kv/partition.h"
#include "kv/shard_ops.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

// Kept ids per block of a feature read in batch order (the group lookup's
// kLeanPooledBlock): the block's ids stay in L1, its rows in L2.
constexpr int64_t kBlockIds = 1024;
// Ids per chunk of a feature looked up shard by shard: enough per shard
// for each shard's lookup to stay within its own memory a while.
constexpr int64_t kChunkIds = 1 << 16;
// Rows per unit of work at least, when features are split over threads.
constexpr int64_t kMinUnitRows = 256;

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

class StackedPooledLookupOp : public OpKernel {
 public:
  explicit StackedPooledLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    const int T = num_tables_, F = num_features_;
    const Tensor& ids_t = ctx->input(T);
    OP_REQUIRES(ctx, ids_t.dims() == 3 && ids_t.dim_size(1) == F,
                errors::InvalidArgument("ids must be [batch, ", F, ", length], got ",
                                        ids_t.shape().DebugString()));
    std::vector<TableSlot> tables(T);
    for (int t = 0; t < T; ++t) {
      OP_REQUIRES_OK(ctx, ResolveTable(ctx, t, t, key_dtypes_[t], dims_[t], &tables[t]));
    }
    const int64_t batch = ids_t.dim_size(0), len = ids_t.dim_size(2);
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, width_}), &out_t));
    if (batch == 0) return;
    float* out = out_t->flat<float>().data();
    const int64_t per_row = std::max<int64_t>(len, 1);
    // Each feature's kept ids (room for all its ids) and row splits, in one
    // pass over the input (features split over the threads).
    Tensor kept_t, splits_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64, TensorShape({F, batch * len + 1}),
                                           &kept_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64, TensorShape({F, batch + 1}), &splits_t));
    std::vector<int64_t*> kept(F), splits(F);
    for (int f = 0; f < F; ++f) {
      kept[f] = kept_t.flat<int64_t>().data() + f * (batch * len + 1);
      splits[f] = splits_t.flat<int64_t>().data() + f * (batch + 1);
    }
    std::vector<int64_t> num_kept(F, 0);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    tf::Shard(workers->num_threads, workers->workers, F, batch * len,  // ~1 cycle an id
              [&](int64_t j0, int64_t j1) {
                if (ids_t.dtype() == tf::DT_INT64) {
                  KeepRowsAnyLength(ids_t.flat<int64_t>().data(), F, len, batch, j0, j1,
                                    kept.data(), splits.data(), num_kept.data());
                } else {
                  KeepRowsAnyLength(ids_t.flat<int32_t>().data(), F, len, batch, j0, j1,
                                    kept.data(), splits.data(), num_kept.data());
                }
              });
    // Decided once here (a table's size may change under a concurrent
    // training lookup). Features of tables read shard by shard are one
    // unit each, with a row buffer for a chunk of their ids; the others
    // are split over the threads when there are fewer than two a thread.
    const int threads = workers->num_threads;
    const int64_t ranges = std::max<int64_t>(
        1, std::min<int64_t>((2 * threads + F - 1) / F, batch / kMinUnitRows));
    struct Unit {
      int feature;
      int64_t begin, end;
      float* buffer;  // rows of a chunk, for a table read shard by shard
    };
    std::vector<Unit> units;
    std::vector<Tensor> buffers;
    for (int f = 0; f < F; ++f) {
      const TableSlot& t = tables[feature_tables_[f]];
      if (t.PrefersOrderedLookup(num_kept[f])) {
        for (int64_t r = 0; r < ranges; ++r) {
          units.push_back({f, batch * r / ranges, batch * (r + 1) / ranges, nullptr});
        }
        continue;
      }
      // A chunk holds kChunkIds ids, or one row with its default id.
      buffers.emplace_back();
      const int64_t chunk = std::min(num_kept[f] + batch, std::max(kChunkIds, per_row) + 1);
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT,
                                             TensorShape({chunk, dims_[feature_tables_[f]]}),
                                             &buffers.back()));
      units.push_back({f, 0, batch, buffers.back().flat<float>().data()});
    }
    // Every other call walks the features in reverse: the tables read last
    // by one call are read first by the next, while still in the
    // last-level cache (as the group lookup does).
    if (calls_.fetch_add(1, std::memory_order_relaxed) & 1) {
      std::reverse(units.begin(), units.end());
    }
    std::vector<absl::Status> status(units.size());
    int64_t cost = 0;
    for (const Unit& u : units) cost += (u.end - u.begin) * per_row;
    cost = 60 * (cost / static_cast<int64_t>(units.size()) + 1);
    OP_REQUIRES_OK(ctx, ParallelFor(ctx, static_cast<int64_t>(units.size()), cost,
                                    [&](int64_t i) {
      const Unit& u = units[i];
      const TableSlot& t = tables[feature_tables_[u.feature]];
      const int f = u.feature;
      status[i] = t.t64 ? Feature(t.t64->table(), f, kept[f], splits[f], u.begin, u.end,
                                  u.buffer, out)
                        : Feature(t.t32->table(), f, kept[f], splits[f], u.begin, u.end,
                                  u.buffer, out);
    }));
    for (const absl::Status& s : status) OP_REQUIRES_OK(ctx, s);
  }

 private:
  absl::Status Init(OpKernelConstruction* ctx) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &num_tables_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_features", &num_features_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("table_key_dtypes", &key_dtypes_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("table_dims", &dims_));
    std::vector<std::string> combiners;
    TF_RETURN_IF_ERROR(ctx->GetAttr("feature_tables", &feature_tables_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &combiners));
    TF_RETURN_IF_ERROR(ctx->GetAttr("default_ids", &default_ids_));
    const size_t T = static_cast<size_t>(num_tables_), F = static_cast<size_t>(num_features_);
    if (key_dtypes_.size() != T || dims_.size() != T) {
      return errors::InvalidArgument("table_key_dtypes and table_dims must each have num_tables = ",
                                     num_tables_, " entries, got ", key_dtypes_.size(), " and ",
                                     dims_.size());
    }
    for (size_t t = 0; t < T; ++t) {
      if (dims_[t] < 1) return errors::InvalidArgument("table_dims[", t, "] must be >= 1, got ", dims_[t]);
    }
    if (feature_tables_.size() != F || combiners.size() != F || default_ids_.size() != F) {
      return errors::InvalidArgument("feature_tables, combiners and default_ids must each have "
                                     "num_features = ", num_features_, " entries");
    }
    combiners_.resize(F);
    columns_.resize(F);
    width_ = 0;
    for (size_t f = 0; f < F; ++f) {
      const int64_t t = feature_tables_[f];
      if (t < 0 || t >= num_tables_) {
        return errors::InvalidArgument("feature_tables[", f, "] = ", t,
                                       " is not a table index in [0, ", num_tables_, ")");
      }
      if (!ParseCombiner(combiners[f], &combiners_[f])) {
        return errors::InvalidArgument("combiners[", f, "] must be sum, mean or sqrtn, got '",
                                       combiners[f], "'");
      }
      if (key_dtypes_[t] == tf::DT_INT32 &&
          default_ids_[f] > std::numeric_limits<int32_t>::max()) {
        return errors::InvalidArgument("default_ids[", f, "] = ", default_ids_[f],
                                       " does not fit table ", t, "'s int32 keys");
      }
      columns_[f] = width_;
      width_ += dims_[t];
    }
    return absl::OkStatus();
  }

  // Rows [begin, end) of feature f from `table`, its kept ids kept[] with
  // row splits splits[]; `buffer` non-null: read shard by shard, in chunks,
  // into it.
  template <typename K>
  absl::Status Feature(kv::Table<K>& table, int f, const int64_t* kept, const int64_t* splits,
                       int64_t begin, int64_t end, float* buffer, float* out) const {
    thread_local Block<K> blk;
    const int64_t dim = dims_[feature_tables_[f]];
    const int64_t def = default_ids_[f];
    const Combiner comb = combiners_[f];
    out += columns_[f];
    std::optional<typename kv::Table<K>::OrderedReader> reader;
    if (buffer == nullptr) reader.emplace(table);
    const int64_t max_ids = buffer == nullptr ? kBlockIds : kChunkIds;
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
            if (kept[j] > std::numeric_limits<K>::max()) {
              return errors::InvalidArgument("id ", kept[j], " of feature ", f, " (ids[", b,
                                             ", ", f, ", :]) does not fit table ",
                                             feature_tables_[f], "'s int32 keys");
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
        FindByShard(table, keys, n, dim, buffer, blk.rows.data());
      }
      blk.rows[n] = kNegativeZeros.data();
      CombinePooledRows(dim, sp, base, first, first + rows, blk.rows.data(),
                        PadPooledRows(max_len, rows, n), n, max_len, comb,
                        out + (b0 - first) * width_, width_);
      b0 = b1;
    }
    kv::StreamFence();  // the streamed stores are ordered before the op completes
    return absl::OkStatus();
  }

  int num_tables_ = 0;
  int num_features_ = 0;
  std::vector<tf::DataType> key_dtypes_;
  std::vector<int64_t> dims_;
  std::vector<int64_t> feature_tables_;
  std::vector<Combiner> combiners_;
  std::vector<int64_t> default_ids_;
  std::vector<int64_t> columns_;  // feature f's first output column
  int64_t width_ = 0;
  std::atomic<uint64_t> calls_{0};  // Compute calls (see the reverse walk)
};

REGISTER_KERNEL_BUILDER(Name("KRE>StackedPooledLookup").Device(tf::DEVICE_CPU),
                        StackedPooledLookupOp);

}  // namespace
}  // namespace kre
