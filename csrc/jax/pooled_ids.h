// Copyright keras_rec_emb authors. Apache-2.0.
//
// The combiners' lookups and updates of the JAX binding (pooled_handlers.cc,
// apply_handlers.cc): a combiner's lookup in one call, ids [rows, L] (and
// per-id weights, or none) -> [rows, dim], row r = sum_k w[r, k] *
// row(ids[r, k]) times 1 / the combiner's denominator ("sum": 1; "mean":
// sum_k w; "sqrtn": sqrt(sum_k w^2); w = 1 without weights; a row whose
// denominator is 0 gives zeros), as keras_rec_emb/_jax/layers.py's
// combine_last_axis. With `prune`, ids < 0 are padding: never inserted nor
// counted, weight 0. With "mean" and "sqrtn" a weight <= 0 counts as 0
// (layers.py has turned those ids into padding already). No [rows, L, dim]
// array of rows goes through XLA: an inference lookup combines the rows
// from the table (kv::Table::OrderedReader, as the TensorFlow pooled
// kernels do), a training one from a block buffer of the lookup that
// inserts. The backward (ApplyPooled) feeds id (r, k) w[r, k] /
// denominator(r) times grads[r] to the fused sparse apply.
//
// The combiners are kre::Combiner (core/pooled_rows.h), as the TensorFlow
// kernels'.
#ifndef KRE_JAX_POOLED_IDS_H_
#define KRE_JAX_POOLED_IDS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/distinct_ids.h"
#include "core/pooled_rows.h"
#include "jax/handlers.h"
#include "kv/table.h"

namespace kre {
namespace jaxbind {

inline ffi::ErrorOr<Combiner> ParseCombinerAttr(std::string_view name) {
  Combiner c = kSum;
  if (ParseCombiner(name, &c)) return c;
  return ffi::Unexpected(
      Invalid("`combiner` must be sum, mean or sqrtn, got '" + string(name) + "'"));
}

// Checks ids [rows, L] and weights ([rows, L], or empty: none).
inline ffi::Error CheckPooled(const ffi::AnyBuffer& keys, const ffi::Buffer<ffi::F32>& weights) {
  const auto kd = keys.dimensions();
  if (kd.size() != 2) return Invalid("`keys` must be [rows, L], got " + Shape(kd));
  const auto wd = weights.dimensions();
  if (weights.element_count() != 0 && !(wd.size() == 2 && wd[0] == kd[0] && wd[1] == kd[1])) {
    return Invalid("`weights` must be empty or have the keys' shape " + Shape(kd) + ", got " +
                   Shape(wd));
  }
  return ffi::Error::Success();
}

// The checks every combiner's call makes: keys of the table's key dtype,
// [rows, L], and weights (CheckPooled); returns its combiner.
inline ffi::ErrorOr<Combiner> CheckPooledCall(const AnyTable& at, const ffi::AnyBuffer& keys,
                                              const ffi::Buffer<ffi::F32>& weights,
                                              std::string_view combiner) {
  if (ffi::Error e = CheckKeys(at, keys); e.failure()) return ffi::Unexpected(e);
  if (ffi::Error e = CheckPooled(keys, weights); e.failure()) return ffi::Unexpected(e);
  return ParseCombinerAttr(combiner);
}

// 1 for an id >= 0, else 0, from its sign bit (the compiler turns a
// comparison into a branch, which padding mispredicts).
template <typename K>
inline int64_t Kept(K id) {
  using U = std::make_unsigned_t<K>;
  return 1 - static_cast<int64_t>(static_cast<U>(id) >> (8 * sizeof(K) - 1));
}

// std::allocator, but `resize` leaves new elements uninitialized: a buffer
// every element of which is written before it is read (no zero fill of
// ids or rows a call overwrites at once).
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) {}  // NOLINT: rebinding
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using Buffer = std::vector<T, Uninitialized<T>>;

// Weight j of a row (weights or nullptr: 1) as `combiner` counts it: with
// "mean" and "sqrtn" a weight <= 0 counts as 0.
inline float PooledWeight(const float* weights, int64_t j, Combiner combiner) {
  const float x = weights == nullptr ? 1.0f : weights[j];
  return combiner != kSum && !(x > 0) ? 0.0f : x;
}

// What weight x adds to its row's denominator.
inline float DenominatorTerm(float x, Combiner combiner) { return combiner == kSqrtn ? x * x : x; }

// 1 / a row's denominator from the sum of its DenominatorTerms (0 when it
// is 0).
inline float InverseDenominator(float denom, Combiner combiner) {
  if (combiner == kSqrtn) denom = std::sqrt(denom);
  return combiner == kSum ? 1.0f : denom > 0 ? 1.0f / denom : 0.0f;
}

// The ids a pooled call looks up (all, or with `prune` those >= 0), in
// batch order, each with its output row and weight, and each row's
// 1 / denominator. `keys`, `row` and `w` have room for every id; the first
// size() entries are the looked-up ones.
template <typename K>
struct PooledIds {
  // Of ids k [rows, len], weights of their shape or nullptr.
  PooledIds(const K* k, const float* weights, int64_t rows, int64_t len, bool prune,
            Combiner combiner)
      : PooledIds(rows, len, prune, combiner) {
    for (int64_t r = 0; r < rows; ++r) {
      AddRow(r, k + r * len, weights == nullptr ? nullptr : weights + r * len);
    }
  }
  // Empty, for AddRow of rows 0, 1, ... rows - 1 of len ids each.
  PooledIds(int64_t rows, int64_t len, bool prune, Combiner combiner)
      : keys(rows * len),
        row(rows * len),
        w(rows * len),
        inv(rows),
        len_(len),
        prune_(prune),
        combiner_(combiner) {}
  // Row r's ids k[0..len) and weights (or nullptr). Every id is written at
  // the next free entry, which only a kept one takes: no branch on which
  // are padding (1-5 ids in a row pad unpredictably). A dropped id's term
  // adds +0 to the denominator: the kept ids' sum, exactly ("sum" has none).
  void AddRow(int64_t r, const K* k, const float* weights) {
    if (weights != nullptr) weighted_ = true;
    float denom = 0;
    K* kk = keys.data() + n_;
    int32_t* rr = row.data() + n_;
    float* ww = w.data() + n_;
    int64_t m = 0;
    for (int64_t j = 0; j < len_; ++j) {
      const int64_t keep = prune_ ? Kept(k[j]) : 1;
      const float x = PooledWeight(weights, j, combiner_);
      kk[m] = k[j];
      rr[m] = static_cast<int32_t>(r);
      ww[m] = x;
      if (combiner_ != kSum) denom += keep ? DenominatorTerm(x, combiner_) : 0.0f;
      m += keep;
    }
    n_ += m;
    inv[r] = InverseDenominator(denom, combiner_);
  }
  int64_t size() const { return n_; }
  // Whether any row came with weights (else every id weighs 1).
  bool weighted() const { return weighted_; }
  Combiner combiner() const { return combiner_; }

  Buffer<K> keys;
  Buffer<int32_t> row;
  Buffer<float> w;
  std::vector<float> inv;

 private:
  const int64_t len_;
  const bool prune_;
  const Combiner combiner_;
  int64_t n_ = 0;
  bool weighted_ = false;
};

// Sums weighted rows into the output rows by non-decreasing row index,
// block after block (a row's ids may span blocks), and stores each row
// times its 1 / denominator; Finish() stores the last one and zeros the
// rows no id reached. Output row r is out[r * stride, r * stride + dim)
// (a stride > dim: one feature's columns of a group's concatenated rows).
class RowSums {
 public:
  RowSums(float* out, const float* inv, int64_t rows, int64_t dim, int64_t stride = -1)
      : out_(out),
        inv_(inv),
        rows_(rows),
        dim_(dim),
        stride_(stride < 0 ? dim : stride),
        acc_(dim, 0.0f) {}

  void Add(const int32_t* row, const float* w, const float* const* src, int64_t n) {
    Dispatch([&](auto d) { AddFixed<decltype(d)::value>(row, w, Pointers{src}, n); });
  }

  // Add of the rows base + index[i] * dim.
  template <typename I>
  void AddIndexed(const int32_t* row, const float* w, const float* base, const I* index,
                  int64_t n) {
    Dispatch(
        [&](auto d) { AddFixed<decltype(d)::value>(row, w, Indexed<I>{base, index, dim_}, n); });
  }

  void Finish() {
    Store(acc_.data());
    Zero(rows_);
  }

 private:
  // The rows Add reads: src[i].
  struct Pointers {
    const float* const* src;
    const float* operator()(int64_t i) const { return src[i]; }
  };
  // base + index[i] * dim.
  template <typename I>
  struct Indexed {
    const float* base;
    const I* index;
    int64_t dim;
    const float* operator()(int64_t i) const { return base + static_cast<int64_t>(index[i]) * dim; }
  };

  // fn(std::integral_constant<int, D>) for the compiled width D of dim_ (0:
  // any).
  template <typename Fn>
  void Dispatch(Fn&& fn) {
    switch (dim_) {
      case 4:
        return fn(std::integral_constant<int, 4>());
      case 8:
        return fn(std::integral_constant<int, 8>());
      case 16:
        return fn(std::integral_constant<int, 16>());
      case 32:
        return fn(std::integral_constant<int, 32>());
      case 64:
        return fn(std::integral_constant<int, 64>());
      default:
        return fn(std::integral_constant<int, 0>());
    }
  }

  // D > 0: rows of D floats, the sum in a local array (registers); D = 0:
  // of dim_ floats, in acc_. src(i) is row i.
  template <int D, typename Src>
  void AddFixed(const int32_t* row, const float* w, const Src& src, int64_t n) {
    const int64_t dim = D > 0 ? D : dim_;
    float local[D > 0 ? D : 1];
    float* acc = D > 0 ? local : acc_.data();
    if (D > 0) std::copy(acc_.begin(), acc_.end(), acc);
    // The rows are read at random (a distinct id's, or the table's):
    // fetched kAhead ids ahead.
    constexpr int64_t kAhead = 8;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(src(i + kAhead));
      if (row[i] != cur_) {
        Store(acc);
        Zero(row[i]);
        cur_ = row[i];
        std::fill(acc, acc + dim, 0.0f);
      }
      const float s = w[i];
      const float* r = src(i);
      for (int64_t d = 0; d < dim; ++d) acc[d] += s * r[d];
    }
    if (D > 0) std::copy(acc, acc + dim, acc_.begin());
  }

  void Store(const float* acc) {
    if (cur_ < 0) return;
    float* o = out_ + cur_ * stride_;
    const float c = inv_[cur_];
    for (int64_t d = 0; d < dim_; ++d) o[d] = acc[d] * c;
  }

  // Zeros the rows after the current one, up to `next`.
  void Zero(int64_t next) {
    for (int64_t r = cur_ + 1; r < next; ++r) {
      std::fill(out_ + r * stride_, out_ + r * stride_ + dim_, 0.0f);
    }
    cur_ = std::max<int64_t>(cur_, next - 1);
  }

  float* const out_;
  const float* const inv_;
  const int64_t rows_, dim_, stride_;
  int64_t cur_ = -1;
  std::vector<float> acc_;
};

// Inference lookups find this many ids' row pointers at a time (they stay
// in L1, the rows in L2), as the TensorFlow pooled kernels do.
constexpr int64_t kPooledReadBlock = 1024;

// The distinct ids of a pooled call, in first-seen order, each with its
// hash and count, grouped by shard (core/distinct_ids.h, as the TensorFlow
// group op's) for kv::Table::LookupCounted, and the index of every id among
// them: a training lookup reads each distinct id once, counted as often as
// it occurs, instead of once per occurrence.
template <typename K>
struct DistinctIds {
  // The distinct ids of k[0..n).
  DistinctIds(const kv::Table<K>& table, const K* k, int64_t n) : inverse(n + 1) {
    DistinctBuilder<K> distinct(n, &uniq, &hashes, &counts);
    distinct.AddAll(
        n, [&](int64_t i) { return k[i]; }, [](K key) { return kv::Table<K>::Hash(key); },
        inverse.data());
    inverse[n] = -1;
    GroupByShard(table, uniq.data(), hashes.data(), size(), &by_shard);
  }
  // Ids known to be distinct (no counts, no inverse): for an update.
  DistinctIds(const kv::Table<K>& table, const K* distinct, int64_t m, bool /*distinct*/)
      : uniq(distinct, distinct + m), hashes(m) {
    for (int64_t u = 0; u < m; ++u) hashes[u] = kv::Table<K>::Hash(uniq[u]);
    GroupByShard(table, uniq.data(), hashes.data(), size(), &by_shard);
  }
  int64_t size() const { return static_cast<int64_t>(uniq.size()); }

  // Looks every distinct id up once: row u of `rows` ([size(), dim]) is
  // uniq[u]'s.
  void Lookup(kv::Table<K>& table, bool insert, float* rows) const {
    LookupCountedByShard(table, by_shard, counts.data(), insert, rows);
  }

  std::vector<K> uniq;
  std::vector<uint64_t> hashes;
  std::vector<int32_t> counts;
  // Id i's index among the distinct ids (int32: as the calls' `inverse`
  // output), then -1: a loop over the ids with padding among them may read
  // the entry after the last id's.
  Buffer<int32_t> inverse;
  kv::Partitioned<K> by_shard;  // uniq by shard (GroupByShard)
};

// A training pooled lookup through the distinct ids `d` of p's ids.
template <typename K>
void PooledLookupDistinctRows(kv::Table<K>& table, const PooledIds<K>& p, const DistinctIds<K>& d,
                              float* out, int64_t rows, int64_t out_stride = -1) {
  const int64_t dim = table.dim(), n = p.size();
  // The lookup writes every distinct id's row (as the TensorFlow group
  // op's, into an uninitialized buffer).
  Buffer<float> buffer(d.size() * dim);
  d.Lookup(table, /*insert=*/true, buffer.data());
  if (!p.weighted()) {
    // Unweighted ids: the combine of the TensorFlow group op's and of the
    // inference lookups (CombinePooledRows: sums in registers, short rows
    // padded branch-free) from the distinct rows' pointers; RowSums'
    // results but for a row of one id that is -0.0 (x, not 0 + x).
    const int64_t stride = out_stride < 0 ? dim : out_stride;
    Buffer<int64_t> splits(rows + 1);
    std::fill(splits.begin(), splits.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++splits[p.row[i] + 1];
    for (int64_t r = 0; r < rows; ++r) splits[r + 1] += splits[r];
    Buffer<const float*> ptrs(n + 1);
    CombineIndexedRows(dim, splits.data(), 0, rows, buffer.data(), d.inverse.data(), p.combiner(),
                       out, stride, ptrs.data());
    return;
  }
  RowSums sums(out, p.inv.data(), rows, dim, out_stride);
  sums.AddIndexed(p.row.data(), p.w.data(), buffer.data(), d.inverse.data(), n);
  sums.Finish();
}

// Output row r at out[r * out_stride] (-1: the table's dim).
template <typename K>
void PooledLookupRows(kv::Table<K>& table, const PooledIds<K>& p, bool insert, float* out,
                      int64_t rows, int64_t out_stride = -1) {
  const int64_t dim = table.dim(), n = p.size();
  RowSums sums(out, p.inv.data(), rows, dim, out_stride);
  std::vector<const float*> ptrs;
  std::vector<float> buffer;
  auto point_at_buffer = [&](int64_t m) {
    ptrs.resize(m);
    buffer.resize(m * dim);
    for (int64_t i = 0; i < m; ++i) ptrs[i] = buffer.data() + i * dim;
  };
  if (n > 0 && table.PrefersOrderedLookup(n) && !insert) {
    ptrs.resize(std::min(kPooledReadBlock, n));
    typename kv::Table<K>::OrderedReader reader(table);
    for (int64_t b = 0; b < n; b += kPooledReadBlock) {
      const int64_t m = std::min(kPooledReadBlock, n - b);
      reader.Find(p.keys.data() + b, m, ptrs.data(), /*read_later=*/true);
      sums.Add(p.row.data() + b, p.w.data() + b, ptrs.data(), m);
    }
  } else if (n > 0 && insert) {
    PooledLookupDistinctRows(table, p, DistinctIds<K>(table, p.keys.data(), n), out, rows,
                             out_stride);
    return;
  } else if (n > 0 && table.PrefersOrderedLookup(n)) {
    // In batch order (see LookupRows), a block at a time.
    constexpr int64_t kBlock = kv::Table<K>::kOrderedBlock;
    point_at_buffer(std::min(kBlock, n));
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t m = std::min(kBlock, n - b);
      table.LookupOrdered(p.keys.data() + b, m, insert, buffer.data(), dim);
      sums.Add(p.row.data() + b, p.w.data() + b, ptrs.data(), m);
    }
  } else if (n > 0) {
    point_at_buffer(n);
    LookupRows(table, p.keys.data(), n, insert, buffer.data());
    sums.Add(p.row.data(), p.w.data(), ptrs.data(), n);
  }
  sums.Finish();
}

}  // namespace jaxbind
}  // namespace kre

#endif  // KRE_JAX_POOLED_IDS_H_
