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
// prefers it), combined straight into its columns of out (row stride
// `width`).
template <typename K>
void GroupPooledRows(const std::vector<std::shared_ptr<AnyTable>>& tables,
                     const std::vector<Combiner>& comb, const K* k, int64_t rows, int64_t len,
                     bool prune, float* out, int64_t width) {
  const int64_t features = static_cast<int64_t>(tables.size());
  // Feature f's kept ids at kept[f * cap], room for rows * len and a cache
  // line more: with a multiple of 4 KiB apart, the features' ids stored
  // row after row would all fall in one set of the L1 cache and evict each
  // other at every row.
  const int64_t cap = (rows * len + 7) / 8 * 8 + 8;
  // Reused call after call: no allocation nor zeroing once they are large
  // enough; feature f's splits at splits[f * (rows + 1)].
  thread_local std::vector<int64_t> kept, splits;
  thread_local std::vector<float> buffer;
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
  std::vector<int64_t> offset(features + 1, 0);
  for (int64_t f = 0; f < features; ++f) offset[f + 1] = offset[f] + tables[f]->dim();
  // Every other call walks the features in reverse, as the TensorFlow group
  // op does: the tables read last by one call are read first by the next,
  // while still in the last-level cache.
  static std::atomic<uint64_t> calls{0};
  const bool reverse = calls.fetch_add(1, std::memory_order_relaxed) & 1;
  for (int64_t i = 0; i < features; ++i) {
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
                               width,
                               static_cast<int>(f),
                               static_cast<int>(f)};
        float* rows_buffer = nullptr;
        if (!tab.PrefersOrderedLookup(count[f])) {
          // len bounds every row's ids.
          buffer.resize(PooledBufferRows(count[f], rows, len) * dim);
          rows_buffer = buffer.data();
        }
        // The ids came as K: every one fits the table's keys.
        PooledRowsOf(tab, pf, 0, rows, rows_buffer);
      }
    });
  }
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
                             bool prune) {
  return Guarded([&]() -> ffi::Error {
    const auto kd = keys.dimensions();
    if (kd.size() != 3) return Invalid("`keys` must be [rows, features, L], got " + Shape(kd));
    const int64_t rows = kd[0], features = kd[1], len = kd[2];
    const auto wd = weights.element_count() == 0 ? kd : weights.dimensions();
    if (!(wd.size() == 3 && wd[0] == rows && wd[1] == features && wd[2] == len)) {
      return Invalid("`weights` must be empty or have the keys' shape " + Shape(kd) + ", got " +
                     Shape(weights.dimensions()));
    }
    const std::vector<string> names = SplitNames(combiners);
    if (static_cast<int64_t>(tables.size()) != features ||
        static_cast<int64_t>(names.size()) != features) {
      return Invalid("`tables` and `combiners` must name one table and one combiner per feature (" +
                     std::to_string(features) + "), got " + std::to_string(tables.size()) +
                     " and " + std::to_string(names.size()));
    }
    std::vector<std::shared_ptr<AnyTable>> found;
    std::vector<Combiner> comb;
    int64_t width = 0;
    for (int64_t f = 0; f < features; ++f) {
      auto t = Find(tables[f]);
      if (t.has_error()) return t.error();
      if (ffi::Error e = CheckKeys(**t, keys); e.failure()) return e;
      auto c = ParseCombinerAttr(names[f]);
      if (c.has_error()) return c.error();
      width += (*t)->dim();
      found.push_back(*t);
      comb.push_back(*c);
    }
    if (out->dimensions()[0] != rows || out->dimensions()[1] != width) {
      return Invalid("`out` must be [" + std::to_string(rows) + ", " + std::to_string(width) +
                     "] (the features' dims summed), got " + Shape(out->dimensions()));
    }
    const float* w = OptionalWeights(weights);
    found[0]->Visit([&](auto& first) {
      using K = KeyOfT<decltype(first)>;
      if (w == nullptr) {
        GroupPooledRows(found, comb, keys.reinterpret_data<K>(), rows, len, prune,
                        out->typed_data(), width);
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
      int64_t offset = 0;
      for (int64_t f = 0; f < features; ++f) {
        // All tables have K keys (CheckKeys); the visit gives the type.
        found[f]->Visit([&](auto& tab) {
          if constexpr (std::is_same_v<KeyOfT<decltype(tab)>, K>) {
            PooledLookupRows(tab, ids[f], /*insert=*/false, out->typed_data() + offset, rows,
                             width);
          }
        });
        offset += found[f]->dim();
      }
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
      const K* k = keys.reinterpret_data<K>();
      const PooledIds<K> p(k, w, rows, len, prune, *comb);
      const DistinctIds<K> d(tab, p.keys.data(), p.size());
      PooledLookupDistinctRows(tab, p, d, out->typed_data(), rows);
      int32_t* inv = inverse->typed_data();
      for (int64_t j = 0, i = 0; j < rows * len; ++j) {
        inv[j] = prune && k[j] < 0 ? -1 : static_cast<int32_t>(d.inverse[i++]);
      }
      K* dst = distinct->reinterpret_data<K>();
      std::copy(d.uniq.begin(), d.uniq.end(), dst);
      std::fill(dst + d.size(), dst + rows * len, K{0});
      SetInt(*count, 0, d.size());
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
         .Attr<bool>("prune")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTablePooledLookupDistinct, PooledLookupDistinct,
                              (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>>,
                                            Rets<ffi::BufferR2<ffi::F32>, ffi::BufferR2<ffi::S32>,
                                                 ffi::AnyBuffer, ffi::AnyBuffer>>()
                                   .Attr<int64_t>("table")
                                   .Attr<bool>("prune")
                                   .Attr<std::string_view>("combiner")));

#pragma GCC visibility pop

}  // namespace jaxbind
}  // namespace kre
