// Copyright keras_rec_emb authors. Apache-2.0.
//
// The combiners' lookups as XLA FFI handlers (pooled_ids.h says what they
// compute): one table's (PooledLookup; PooledLookupDistinct, which also
// returns the distinct ids its backward, ApplyDistinct, updates), and a
// group's inference lookup of every feature into one concatenated output
// (GroupPooledLookup, by the TensorFlow kernels' core/keep_rows.h and
// core/pooled_rows.h). handlers.h says what every handler shares.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/keep_rows.h"
#include "core/pooled_rows.h"
#include "jax/handlers.h"
#include "jax/pooled_ids.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace kre {
namespace jaxbind {
namespace {

// The checks of a pooled lookup's operands (keys [rows, L], weights, `out`
// [rows, dim]); returns its combiner.
ffi::ErrorOr<Combiner> CheckPooledLookup(AnyTable& at, ffi::AnyBuffer keys,
                                         ffi::Buffer<ffi::F32> weights,
                                         ffi::Buffer<ffi::F32, 2> out, std::string_view combiner) {
  auto comb = CheckPooledCall(at, keys, weights, combiner);
  if (comb.has_error()) return comb;
  if (ffi::Error e = CheckShape2(out.dimensions(), "out", keys.dimensions()[0], at.dim());
      e.failure()) {
    return ffi::Unexpected(e);
  }
  return comb;
}

ffi::Error PooledLookup(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                        ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 2> out, int64_t table,
                        bool insert, bool prune, std::string_view combiner) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    auto comb = CheckPooledLookup(at, keys, weights, *out, combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = keys.dimensions()[0], len = keys.dimensions()[1];
    const float* w = OptionalWeights(weights);
    at.Visit([&](auto& tab) {
      using K = KeyOfT<decltype(tab)>;
      const PooledIds<K> p(keys.reinterpret_data<K>(), w, rows, len, prune, *comb);
      PooledLookupRows(tab, p, insert, out->typed_data(), rows);
    });
    return ffi::Error::Success();
  });
}

// GroupPooledLookup without weights, by the TensorFlow stacked kernel's
// KeepRows and PooledRowsOf: every feature's kept ids (all, or with `prune`
// those >= 0) and CSR splits in one pass over the ids k [rows, F, len] in
// memory order (feature after feature over all rows would stride through
// them: a cache line per row and feature), then feature after feature its
// rows in blocks read in batch order (or shard by shard, a table that
// prefers it), combined straight into its columns of out (feature f's
// [offset[f], offset[f + 1]), row stride offset.back()).
template <typename K>
void GroupPooledRows(const std::vector<std::shared_ptr<AnyTable>>& tables,
                     const std::vector<Combiner>& comb, const K* k, int64_t rows, int64_t len,
                     bool prune, float* out, const std::vector<int64_t>& offset,
                     ffi::ThreadPool& pool) {
  const int64_t features = static_cast<int64_t>(tables.size());
  // Feature f's kept ids at kept[f * cap], room for rows * len and a cache
  // line more: with a multiple of 4 KiB apart, the features' ids stored
  // row after row would all fall in one set of the L1 cache and evict each
  // other at every row.
  const int64_t cap = (rows * len + 7) / 8 * 8 + 8;
  // Reused call after call: no allocation nor zeroing once they are large
  // enough; feature f's splits at splits[f * (rows + 1)].
  thread_local std::vector<int64_t> kept, splits;
  if (static_cast<int64_t>(kept.size()) < features * cap) kept.resize(features * cap);
  if (static_cast<int64_t>(splits.size()) < features * (rows + 1)) {
    splits.resize(features * (rows + 1));
  }
  std::vector<int64_t*> kept_of(features), splits_of(features);
  for (int64_t f = 0; f < features; ++f) {
    kept_of[f] = kept.data() + f * cap;
    splits_of[f] = splits.data() + f * (rows + 1);
  }
  std::vector<int64_t> count(features, 0);
  KeepRowsAnyLength(k, features, len, rows, 0, features, kept_of.data(), splits_of.data(),
                    count.data(), prune);
  // Every other call walks the features in reverse, as the TensorFlow group
  // op does: the tables read last by one call are read first by the next,
  // while still in the last-level cache. With a pool of 2+ threads the
  // features are read side by side, as the TensorFlow op's units are.
  static std::atomic<uint64_t> calls{0};
  const bool reverse = calls.fetch_add(1, std::memory_order_relaxed) & 1;
  OnPool(pool, features, [&](int64_t i) {
    const int64_t f = reverse ? features - 1 - i : i;
    const int64_t dim = tables[f]->dim();
    // All tables have K keys (CheckKeys); the visit gives the type.
    tables[f]->Visit([&](auto& tab) {
      if constexpr (std::is_same_v<KeyOfT<decltype(tab)>, K>) {
        const PooledFeature pf{kept_of[f],
                               splits_of[f],
                               dim,
                               /*default_id=*/-1,
                               comb[f],
                               out + offset[f],
                               offset.back(),
                               static_cast<int>(f),
                               static_cast<int>(f)};
        float* rows_buffer = nullptr;
        thread_local std::vector<float> buffer;
        if (!tab.PrefersOrderedLookup(count[f])) {
          // len bounds every row's ids.
          buffer.resize(PooledBufferRows(count[f], rows, len) * dim);
          rows_buffer = buffer.data();
        }
        // The ids came as K: every one fits the table's keys.
        PooledRowsOf(tab, pf, 0, rows, rows_buffer);
      }
    });
  });
}

// A training pooled lookup of ids k [rows, len] (weights of their shape or
// nullptr) into out (row stride `out_stride`, -1: the dim) through their
// distinct ids, returning what ApplyDistinct needs: inv [rows, len], each
// id's index among the distinct ids (-1 for a pruned one), and dst (room
// for rows * len ids), the distinct ids first seen first, then zeros.
// Returns how many there are.
template <typename K>
int64_t DistinctPooledLookup(kv::Table<K>& tab, const K* k, const float* w, int64_t rows,
                             int64_t len, bool prune, Combiner comb, float* out, int64_t out_stride,
                             int32_t* inv, K* dst) {
  const PooledIds<K> p(k, w, rows, len, prune, comb);
  const DistinctIds<K> d(tab, p.keys.data(), p.size());
  PooledLookupDistinctRows(tab, p, d, out, rows, out_stride);
  // Branch-free: 1-5 ids in a row pad unpredictably. d.inverse[n] is -1,
  // read after the last kept id.
  for (int64_t j = 0, i = 0; j < rows * len; ++j) {
    const int64_t keep = prune ? Kept(k[j]) : 1;
    // u for a kept id, u | -1 = -1 for a pruned one.
    inv[j] = d.inverse[i] | static_cast<int32_t>(keep - 1);
    i += keep;
  }
  std::copy(d.uniq.begin(), d.uniq.end(), dst);
  std::fill(dst + d.size(), dst + rows * len, K{0});
  return d.size();
}

// The tables, combiners and column offsets of a group's lookup of ids keys
// [rows, F, L] (with `feature_major`, [F, rows, L]; weights empty or of
// their shape) into out [rows, sum of the tables' dims], its tables not yet
// settled; with `feature_major` no table may serve two features (a
// training lookup's tables are looked up side by side).
struct Group {
  std::vector<std::shared_ptr<AnyTable>> tables;
  std::vector<Combiner> combiners;
  // Feature f's columns [offset[f], offset[f + 1]) of the output's
  // offset.back() (the dims one after the other).
  std::vector<int64_t> offset{0};
};

ffi::ErrorOr<Group> CheckGroup(const ffi::AnyBuffer& keys, const ffi::Buffer<ffi::F32>& weights,
                               ffi::Span<const int64_t> out, ffi::Span<const int64_t> tables,
                               std::string_view combiners, bool feature_major) {
  auto fail = [](const string& message) { return ffi::Unexpected(Invalid(message)); };
  const auto kd = keys.dimensions();
  if (kd.size() != 3) {
    return fail(string("`keys` must be ") +
                (feature_major ? "[features, rows, L]" : "[rows, features, L]") + ", got " +
                Shape(kd));
  }
  const int64_t rows = kd[feature_major ? 1 : 0], features = kd[feature_major ? 0 : 1];
  const auto wd = weights.element_count() == 0 ? kd : weights.dimensions();
  if (!(wd.size() == 3 && wd[0] == kd[0] && wd[1] == kd[1] && wd[2] == kd[2])) {
    return fail("`weights` must be empty or have the keys' shape " + Shape(kd) + ", got " +
                Shape(weights.dimensions()));
  }
  const std::vector<string> names = SplitNames(combiners);
  if (static_cast<int64_t>(tables.size()) != features ||
      static_cast<int64_t>(names.size()) != features) {
    return fail("`tables` and `combiners` must name one table and one combiner per feature (" +
                std::to_string(features) + "), got " + std::to_string(tables.size()) + " and " +
                std::to_string(names.size()));
  }
  Group group;
  for (int64_t f = 0; f < features; ++f) {
    if (feature_major) {
      for (int64_t g = 0; g < f; ++g) {
        if (tables[g] == tables[f]) {
          return fail("table " + std::to_string(tables[f]) + " serves features " +
                      std::to_string(g) + " and " + std::to_string(f) +
                      "; a group's training lookup takes one table per feature");
        }
      }
    }
    auto t = FindUnsettled(tables[f]);
    if (t.has_error()) return ffi::Unexpected(t.error());
    if (ffi::Error e = CheckKeys(**t, keys); e.failure()) return ffi::Unexpected(e);
    auto c = ParseCombinerAttr(names[f]);
    if (c.has_error()) return ffi::Unexpected(c.error());
    group.offset.push_back(group.offset.back() + (*t)->dim());
    group.tables.push_back(*t);
    group.combiners.push_back(*c);
  }
  const int64_t width = group.offset.back();
  const bool fits = feature_major ? out.size() == 1 && out[0] == rows * width
                                  : out.size() == 2 && out[0] == rows && out[1] == width;
  if (!fits) {
    return fail("`out` must be [" + std::to_string(rows) + (feature_major ? " * " : ", ") +
                std::to_string(width) + "] (the features' dims summed), got " + Shape(out));
  }
  return group;
}

// A group's inference lookup in one call: feature f's ids keys[:, f, :]
// ([rows, F, L], padded with ids < 0 when `prune`; weights empty or of the
// keys' shape) pooled by combiner f from table f into out's columns
// [offset(f), offset(f) + dim(f)), the features' dims one after the other:
// the concatenated output of the group, with no slice of the ids per feature
// and no per-table outputs to concatenate. It never inserts.
ffi::Error GroupPooledLookup(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                             ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 2> out,
                             ffi::Span<const int64_t> tables, std::string_view combiners,
                             bool prune, ffi::ThreadPool pool) {
  return Guarded([&]() -> ffi::Error {
    auto group =
        CheckGroup(keys, weights, out->dimensions(), tables, combiners, /*feature_major=*/false);
    if (group.has_error()) return group.error();
    auto& [found, comb, offset] = *group;
    for (auto& t : found) t->Settle();
    const auto kd = keys.dimensions();
    const int64_t rows = kd[0], features = kd[1], len = kd[2];
    const float* w = OptionalWeights(weights);
    found[0]->Visit([&](auto& first) {
      using K = KeyOfT<decltype(first)>;
      if (w == nullptr) {
        GroupPooledRows(found, comb, keys.reinterpret_data<K>(), rows, len, prune,
                        out->typed_data(), offset, pool);
        return;
      }
      // With weights: every feature's ids in one pass over the ids in memory order:
      // feature after feature over all rows would stride through them
      // (a cache line per row and feature).
      std::vector<PooledIds<K>> ids;
      ids.reserve(features);
      for (int64_t f = 0; f < features; ++f) ids.emplace_back(rows, len, prune, comb[f]);
      const K* k = keys.reinterpret_data<K>();
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t f = 0; f < features; ++f) {
          const int64_t at = (r * features + f) * len;
          ids[f].AddRow(r, k + at, w + at);
        }
      }
      OnPool(pool, features, [&](int64_t f) {
        // All tables have K keys (CheckKeys); the visit gives the type.
        found[f]->Visit([&](auto& tab) {
          if constexpr (std::is_same_v<KeyOfT<decltype(tab)>, K>) {
            PooledLookupRows(tab, ids[f], /*insert=*/false, out->typed_data() + offset[f], rows,
                             offset.back());
          }
        });
      });
    });
    return ffi::Error::Success();
  });
}

// A group's training lookup in one call: ids keys [F, rows, L] (feature f's
// ids keys[f], contiguous; weights empty or of their shape) pooled into
// `out` [rows * sum of dims], feature f's rows [rows, dim_f] a block at
// rows * (the dims of the features before f): pooled straight into the
// columns of [rows, sum of dims], a feature's pass would write a cache line
// a row of an output larger than the cache (3x the pooling's time at 26
// features of dim 16); XLA joins the blocks (ffi.py). Each feature's table
// inserts and counts its ids as PooledLookupDistinct does, whose extra
// outputs come per feature for the backward (one ApplyDistinct a table):
// `inverse` [F, rows, L], id (f, r, k)'s index among feature f's distinct
// ids (-1 for a pruned one); `distinct` [F, rows * L], row f feature f's
// distinct ids first seen first (then zeros); `counts` [F], how many. Each
// feature has a table of its own, so that with a pool of 2+ threads
// features are looked up side by side (OnPool), each table settled by the
// thread that looks it up.
ffi::Error GroupPooledLookupDistinct(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                                     ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 1> out,
                                     ffi::ResultBuffer<ffi::S32, 3> inverse,
                                     ffi::Result<ffi::AnyBuffer> distinct,
                                     ffi::Result<ffi::AnyBuffer> counts,
                                     ffi::Span<const int64_t> tables, std::string_view combiners,
                                     bool prune, ffi::ThreadPool pool) {
  return Guarded([&]() -> ffi::Error {
    auto group =
        CheckGroup(keys, weights, out->dimensions(), tables, combiners, /*feature_major=*/true);
    if (group.has_error()) return group.error();
    const auto& [found, comb, offset] = *group;
    const auto kd = keys.dimensions();
    const int64_t features = kd[0], rows = kd[1], len = kd[2];
    const auto id = inverse->dimensions();
    if (!(id[0] == features && id[1] == rows && id[2] == len)) {
      return Invalid("`inverse` must have the keys' shape " + Shape(kd) + ", got " + Shape(id));
    }
    if (ffi::Error e = CheckKeys(*found[0], *distinct); e.failure()) return e;
    const auto dd = distinct->dimensions();
    if (!(dd.size() == 2 && dd[0] == features && dd[1] == rows * len)) {
      return Invalid("`distinct` must be [" + std::to_string(features) + ", " +
                     std::to_string(rows * len) + "], got " + Shape(dd));
    }
    if (ffi::Error e = CheckIntVector(*counts, "counts", features); e.failure()) return e;
    const float* w = OptionalWeights(weights);
    float* blocks = out->typed_data();
    OnPool(pool, features, [&](int64_t f) {
      AnyTable& at = *found[f];
      at.Settle();
      at.Visit([&](auto& tab) {
        using K = KeyOfT<decltype(tab)>;
        const int64_t at_f = f * rows * len;
        SetInt(*counts, f,
               DistinctPooledLookup(tab, keys.reinterpret_data<K>() + at_f,
                                    w == nullptr ? nullptr : w + at_f, rows, len, prune, comb[f],
                                    blocks + rows * offset[f], -1, inverse->typed_data() + at_f,
                                    distinct->reinterpret_data<K>() + at_f));
      });
    });
    return ffi::Error::Success();
  });
}

// A training pooled lookup (as PooledLookup with `insert`) that also
// returns what its backward (ApplyDistinct) needs to update each distinct
// id without deduplicating the batch again: `inverse` [rows, L], id
// (r, k)'s index among the distinct ids (-1 for a pruned one); `distinct`
// [rows * L], the distinct ids first seen first (the rest is zeros); and
// `count`, how many there are.
ffi::Error PooledLookupDistinct(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                                ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 2> out,
                                ffi::ResultBuffer<ffi::S32, 2> inverse,
                                ffi::Result<ffi::AnyBuffer> distinct,
                                ffi::Result<ffi::AnyBuffer> count, int64_t table, bool prune,
                                std::string_view combiner) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    auto comb = CheckPooledLookup(at, keys, weights, *out, combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = keys.dimensions()[0], len = keys.dimensions()[1];
    if (inverse->dimensions()[0] != rows || inverse->dimensions()[1] != len) {
      return Invalid("`inverse` must have the keys' shape " + Shape(keys.dimensions()) + ", got " +
                     Shape(inverse->dimensions()));
    }
    if (ffi::Error e = CheckKeys(at, *distinct); e.failure()) return e;
    if (static_cast<int64_t>(distinct->element_count()) != rows * len) {
      return Invalid("`distinct` must hold " + std::to_string(rows * len) + " ids, got shape " +
                     Shape(distinct->dimensions()));
    }
    if (!IsInt(*count) || count->dimensions().size() != 0) {
      return Invalid("`count` must be an int32 or int64 scalar");
    }
    const float* w = OptionalWeights(weights);
    at.Visit([&](auto& tab) {
      using K = KeyOfT<decltype(tab)>;
      SetInt(*count, 0,
             DistinctPooledLookup(tab, keys.reinterpret_data<K>(), w, rows, len, prune, *comb,
                                  out->typed_data(), -1, inverse->typed_data(),
                                  distinct->reinterpret_data<K>()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace

// The handlers' C symbols (extern "C": unmangled), which
// keras_rec_emb/_jax/ffi.py registers with jax.ffi.register_ffi_target.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTablePooledLookup, PooledLookup,
    (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>>, Rets<ffi::BufferR2<ffi::F32>>>()
         .Attr<int64_t>("table")
         .Attr<bool>("insert")
         .Attr<bool>("prune")
         .Attr<std::string_view>("combiner")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreGroupPooledLookup, GroupPooledLookup,
    (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>>, Rets<ffi::BufferR2<ffi::F32>>>()
         .Attr<ffi::Span<const int64_t>>("tables")
         .Attr<std::string_view>("combiners")
         .Attr<bool>("prune")
         .Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTablePooledLookupDistinct, PooledLookupDistinct,
                              (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>>,
                                            Rets<ffi::BufferR2<ffi::F32>, ffi::BufferR2<ffi::S32>,
                                                 ffi::AnyBuffer, ffi::AnyBuffer>>()
                                   .Attr<int64_t>("table")
                                   .Attr<bool>("prune")
                                   .Attr<std::string_view>("combiner")));

// How many threads a table call gets: XLA's intra-op pool's size when it
// has threads to spare (Deferrable), else 1. A group's training lookup is
// one call when it has 2 or more (features side by side), a call a table
// when not (backend/jax/group.py; on one thread the one call over 26
// features took 1.02-1.03x the per-table calls' time: docs/performance.md).
ffi::Error PoolThreads(ffi::Token, ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::S32, 0> threads,
                       ffi::ThreadPool pool) {
  threads->typed_data()[0] = Deferrable(pool) ? pool.num_threads() : 1;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KrePoolThreads, PoolThreads,
    (TokenBinding<Args<>, Rets<ffi::BufferR0<ffi::S32>>>().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreGroupPooledLookupDistinct, GroupPooledLookupDistinct,
                              (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>>,
                                            Rets<ffi::BufferR1<ffi::F32>, ffi::BufferR3<ffi::S32>,
                                                 ffi::AnyBuffer, ffi::AnyBuffer>>()
                                   .Attr<ffi::Span<const int64_t>>("tables")
                                   .Attr<std::string_view>("combiners")
                                   .Attr<bool>("prune")
                                   .Ctx<ffi::ThreadPool>()));

#pragma GCC visibility pop

}  // namespace jaxbind
}  // namespace kre
