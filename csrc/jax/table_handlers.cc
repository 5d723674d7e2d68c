// Copyright keras_rec_emb authors. Apache-2.0.
//
// XLA FFI handlers over the kv::Table engine: the JAX binding's counterpart
// of the TensorFlow kernels (csrc/kernels), linked without TensorFlow.
//
// Every handler takes an XLA token first and returns one first:
// keras_rec_emb/_jax/ffi.py threads JAX's ordered-effect token through
// them, so that table calls run exactly once each, in program order, under
// jit as eagerly (table_registry.h says how tables are found). Table
// management (create, destroy, add slot, size) is not here: those are host
// calls that must run when Python makes them, even while JAX traces
// (table_host.cc).
//
// Errors come back as ffi::Error (InvalidArgument for bad input, naming the
// argument and what is allowed); exceptions of the engine (allocation, a
// file tier's I/O) become ResourceExhausted or DataLoss, never a crash.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "core/keep_rows.h"
#include "core/pooled_rows.h"
#include "core/update_rules.h"
#include "jax/table_registry.h"
#include "kv/partition.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kre {
namespace jaxbind {
namespace {

using std::string;

ffi::Error Invalid(const string& message) { return ffi::Error::InvalidArgument(message); }

ffi::Error Precondition(const string& message) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
}

string Shape(ffi::Span<const int64_t> dims) {
  string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

string DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::F32:
      return "float32";
    default:
      return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// Runs a handler body; an exception that escapes it (the engine's) becomes
// the call's error instead of ending the process.
template <typename Body>
ffi::Error Guarded(Body&& body) {
  try {
    return body();
  } catch (const kv::DataLossError& e) {
    return ffi::Error(ffi::ErrorCode::kDataLoss,
                      string("embedding table operation failed: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      string("embedding table operation failed: ") + e.what());
  }
}

// The table of `handle`, or an error naming it.
ffi::ErrorOr<std::shared_ptr<AnyTable>> Find(int64_t handle) {
  std::shared_ptr<AnyTable> t = Tables().Get(handle);
  if (t == nullptr) {
    return ffi::Unexpected(Invalid("no embedding table has handle " + std::to_string(handle) +
                                   " (it was destroyed, or made in another process)"));
  }
  return t;
}

// Checks that `keys` has the key dtype of `table` (int32 or int64).
ffi::Error CheckKeys(const AnyTable& table, const ffi::AnyBuffer& keys) {
  const ffi::DataType want = table.key_bits() == 64 ? ffi::DataType::S64 : ffi::DataType::S32;
  if (keys.element_type() != want) {
    return Invalid("the embedding table has " + DtypeName(want) + " keys but `keys` is " +
                   DtypeName(keys.element_type()) + "; cast the keys to the table's key dtype");
  }
  return ffi::Error::Success();
}

// Checks that `rows` has shape keys.shape + [dim].
ffi::Error CheckRows(ffi::Span<const int64_t> keys, ffi::Span<const int64_t> rows, int64_t dim,
                     const char* name) {
  bool ok = rows.size() == keys.size() + 1 && rows[keys.size()] == dim;
  for (size_t i = 0; ok && i < keys.size(); ++i) ok = rows[i] == keys[i];
  if (!ok) {
    return Invalid(string("`") + name + "` must have shape keys.shape + [dim] = " + Shape(keys) +
                   " + [" + std::to_string(dim) + "], got " + Shape(rows));
  }
  return ffi::Error::Success();
}

// A scalar int32 or int64 operand as int64.
ffi::ErrorOr<int64_t> IntScalar(const ffi::AnyBuffer& b, const char* name) {
  if (b.dimensions().size() != 0) {
    return ffi::Unexpected(
        Invalid(string("`") + name + "` must be a scalar, got shape " + Shape(b.dimensions())));
  }
  if (b.element_type() == ffi::DataType::S64) return *b.reinterpret_data<int64_t>();
  if (b.element_type() == ffi::DataType::S32) return *b.reinterpret_data<int32_t>();
  return ffi::Unexpected(
      Invalid(string("`") + name + "` must be int32 or int64, got " + DtypeName(b.element_type())));
}

// Writes `value` into integer output `b` (int32 or int64; an int32 output
// saturates).
void SetInt(ffi::AnyBuffer b, int64_t i, int64_t value) {
  if (b.element_type() == ffi::DataType::S64) {
    b.reinterpret_data<int64_t>()[i] = value;
  } else {
    const int64_t lo = std::numeric_limits<int32_t>::min();
    const int64_t hi = std::numeric_limits<int32_t>::max();
    b.reinterpret_data<int32_t>()[i] = static_cast<int32_t>(std::clamp(value, lo, hi));
  }
}

bool IsInt(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::S32 || b.element_type() == ffi::DataType::S64;
}

std::vector<string> SplitNames(std::string_view joined) {
  std::vector<string> out;
  if (joined.empty()) return out;
  size_t start = 0;
  while (true) {
    const size_t comma = joined.find(',', start);
    out.emplace_back(
        joined.substr(start, comma == std::string_view::npos ? joined.npos : comma - start));
    if (comma == std::string_view::npos) return out;
    start = comma + 1;
  }
}

// Runs fn(s) for every shard of a batch partitioned by kv::Partition.
template <typename K>
kv::Partitioned<K> PartitionSerial(const kv::Table<K>& table, const K* keys, int64_t n) {
  return kv::Partition(table, keys, n, 1, [](int num_blocks, auto&& fn) {
    for (int b = 0; b < num_blocks; ++b) fn(b);
  });
}

// --- lookup -----------------------------------------------------------------

template <typename K>
void LookupRows(kv::Table<K>& table, const K* keys, int64_t n, bool insert, float* out) {
  if (n == 0) return;
  const int64_t dim = table.dim();
  if (table.PrefersOrderedLookup(n)) {
    // In batch order, no partition (see kv::Table::PrefersOrderedLookup).
    constexpr int64_t kBlock = kv::Table<K>::kOrderedBlock;
    for (int64_t b = 0; b < n; b += kBlock) {
      table.LookupOrdered(keys + b, std::min(kBlock, n - b), insert, out + b * dim, dim);
    }
    return;
  }
  kv::Partitioned<K> p = PartitionSerial(table, keys, n);
  for (int s = 0; s < table.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    table.Lookup(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                 p.offsets[s + 1] - b, insert, out);
  }
}

// With `prune`, keys < 0 are padding: neither looked up, inserted nor
// counted; their rows are zeros (and `Apply` skips them).
template <typename K>
std::vector<int64_t> KeptPositions(const K* keys, int64_t n) {
  std::vector<int64_t> kept;
  kept.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] >= 0) kept.push_back(i);
  }
  return kept;
}

template <typename K>
void LookupPruned(kv::Table<K>& table, const K* keys, int64_t n, bool insert, float* out) {
  const int64_t dim = table.dim();
  const std::vector<int64_t> kept = KeptPositions(keys, n);
  if (static_cast<int64_t>(kept.size()) == n) {
    // No padding: the rows go straight to `out`.
    LookupRows(table, keys, n, insert, out);
    return;
  }
  std::vector<K> kept_keys(kept.size());
  for (size_t j = 0; j < kept.size(); ++j) kept_keys[j] = keys[kept[j]];
  std::vector<float> rows(kept.size() * dim);
  LookupRows(table, kept_keys.data(), static_cast<int64_t>(kept.size()), insert, rows.data());
  std::fill(out, out + n * dim, 0.0f);
  for (size_t j = 0; j < kept.size(); ++j) {
    std::copy(rows.begin() + j * dim, rows.begin() + (j + 1) * dim, out + kept[j] * dim);
  }
}

ffi::Error Lookup(ffi::Token, ffi::AnyBuffer keys, ffi::Result<ffi::Token>,
                  ffi::ResultBuffer<ffi::F32> out, int64_t table, bool insert, bool prune) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (ffi::Error e = CheckRows(keys.dimensions(), out->dimensions(), at.dim(), "out");
        e.failure()) {
      return e;
    }
    const int64_t n = static_cast<int64_t>(keys.element_count());
    at.Visit([&](auto& tab) {
      using K = KeyOfT<decltype(tab)>;
      if (prune) {
        LookupPruned(tab, keys.reinterpret_data<K>(), n, insert, out->typed_data());
      } else {
        LookupRows(tab, keys.reinterpret_data<K>(), n, insert, out->typed_data());
      }
    });
    return ffi::Error::Success();
  });
}

// --- sparse apply -------------------------------------------------------------

// Checks rule `rule`'s hyper-parameters and the table's slots it names;
// returns the slots' indices.
template <typename Rule, typename K>
ffi::ErrorOr<std::vector<int>> RuleSlots(const kv::Table<K>& table, const string& rule,
                                         const std::vector<string>& slot_names,
                                         ffi::Span<const int64_t> hyper_dims, const float* h) {
  if (hyper_dims.size() != 1 || hyper_dims[0] != Rule::kHyper) {
    return ffi::Unexpected(Invalid("rule '" + rule + "' takes " + std::to_string(Rule::kHyper) +
                                   " hyper-parameters, got shape " + Shape(hyper_dims)));
  }
  for (int i = 0; i < Rule::kHyper; ++i) {
    if (!std::isfinite(h[i])) {
      return ffi::Unexpected(Invalid("`hyper` must be finite; " + string(Rule::kHyperNames[i]) +
                                     " is " + std::to_string(h[i])));
    }
  }
  const size_t needed = Rule::kSlots + (Rule::NeedsExtraSlot(h) ? 1 : 0);
  if (slot_names.size() != needed) {
    return ffi::Unexpected(Invalid("rule '" + rule + "' " + Rule::kSlotsDoc + " needs " +
                                   std::to_string(needed) + " slots, got " +
                                   std::to_string(slot_names.size())));
  }
  std::vector<int> slot_ids;
  const std::vector<kv::SlotSpec> specs = table.Slots();
  for (size_t j = 0; j < slot_names.size(); ++j) {
    const int id = table.SlotIndex(slot_names[j]);
    if (id < 0) {
      return ffi::Unexpected(
          Precondition("the embedding table has no optimizer slot '" + slot_names[j] +
                       "'; add it (add_slot) before applying rule '" + rule + "'"));
    }
    const int64_t width = rules::SlotWidth<Rule>(j, table.dim());
    if (specs[id].width != width) {
      return ffi::Unexpected(Invalid("slot '" + slot_names[j] + "' has width " +
                                     std::to_string(specs[id].width) + ", rule '" + rule +
                                     "' needs " + std::to_string(width)));
    }
    slot_ids.push_back(id);
  }
  return slot_ids;
}

// grad_of(i) is the gradient row of keys[i].
template <typename Rule, typename K, typename GradOf>
ffi::Error ApplyRule(kv::Table<K>& table, const string& rule, const std::vector<string>& slot_names,
                     const K* keys, int64_t n, GradOf&& grad_of,
                     ffi::Span<const int64_t> hyper_dims, const float* h, int64_t step) {
  const int64_t dim = table.dim();
  auto checked = RuleSlots<Rule>(table, rule, slot_names, hyper_dims, h);
  if (checked.has_error()) return checked.error();
  const std::vector<int>& slot_ids = *checked;
  if (n == 0) return ffi::Error::Success();
  const rules::ApplyRow<Rule> update(h, dim);
  // Equal keys summed per shard in batch order (as the TF kernel does),
  // then each shard's distinct keys applied with prefetching. The gradient
  // rows are read once, in batch order: gathered shard by shard they are
  // read at random, which costs more than the sums.
  const int shards = table.num_shards();
  std::vector<uint64_t> hashes(n);
  std::vector<int32_t> shard_of(n);
  std::vector<int64_t> counts(shards, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = kv::Table<K>::Hash(keys[i]);
    shard_of[i] = table.ShardOf(hashes[i]);
    ++counts[shard_of[i]];
  }
  std::vector<rules::DistinctRows<K>> d;
  d.reserve(shards);
  for (int s = 0; s < shards; ++s) d.emplace_back(counts[s], dim);
  for (int64_t i = 0; i < n; ++i) d[shard_of[i]].Add(keys[i], hashes[i], grad_of(i));
  for (int s = 0; s < shards; ++s) {
    table.ApplyDistinct(s, d[s].keys.data(), d[s].hashes.data(), d[s].order.data(), d[s].size(),
                        d[s].sums.data(), slot_ids, step, update);
  }
  return ffi::Error::Success();
}

ffi::Error Apply(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> grads,
                 ffi::Buffer<ffi::F32> hyper, ffi::AnyBuffer step, ffi::Result<ffi::Token>,
                 int64_t table, std::string_view rule_name, std::string_view hparam_names,
                 std::string_view slot_names, bool prune) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (ffi::Error e = CheckRows(keys.dimensions(), grads.dimensions(), at.dim(), "grads");
        e.failure()) {
      return e;
    }
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const string rule(rule_name);
    const std::vector<string> hparams = SplitNames(hparam_names);
    const std::vector<string> slots = SplitNames(slot_names);
    const int64_t n = static_cast<int64_t>(keys.element_count());
    ffi::Error result = Invalid("unknown rule '" + rule + "'");
    rules::WithRule(rule, [&](auto tag) {
      using Rule = typename decltype(tag)::type;
      const string names_error = rules::CheckNames<Rule>(rule, hparams, slots);
      if (!names_error.empty()) {
        result = Invalid(names_error);
        return;
      }
      result = at.Visit([&](auto& tab) {
        using K = KeyOfT<decltype(tab)>;
        const K* k = keys.reinterpret_data<K>();
        if (!prune) {
          const float* g = grads.typed_data();
          return ApplyRule<Rule>(
              tab, rule, slots, k, n, [g, dim = tab.dim()](int64_t i) { return g + i * dim; },
              hyper.dimensions(), hyper.typed_data(), *version);
        }
        const int64_t dim = tab.dim();
        const float* g = grads.typed_data();
        const std::vector<int64_t> kept = KeptPositions(k, n);
        if (static_cast<int64_t>(kept.size()) == n) {  // no padding
          return ApplyRule<Rule>(
              tab, rule, slots, k, n, [g, dim](int64_t i) { return g + i * dim; },
              hyper.dimensions(), hyper.typed_data(), *version);
        }
        std::vector<K> kept_keys(kept.size());
        for (size_t j = 0; j < kept.size(); ++j) kept_keys[j] = k[kept[j]];
        // The gradient of kept id j is read in place, at its position.
        const int64_t* at = kept.data();
        return ApplyRule<Rule>(
            tab, rule, slots, kept_keys.data(), static_cast<int64_t>(kept.size()),
            [g, dim, at](int64_t j) { return g + at[j] * dim; }, hyper.dimensions(),
            hyper.typed_data(), *version);
      });
    });
    return result;
  });
}

// --- pooled lookup and apply (combiners) ------------------------------------
//
// A combiner's lookup in one call: ids [rows, L] (and per-id weights, or
// none) -> [rows, dim], row r = sum_k w[r, k] * row(ids[r, k]) times
// 1 / the combiner's denominator ("sum": 1; "mean": sum_k w; "sqrtn":
// sqrt(sum_k w^2); w = 1 without weights; a row whose denominator is 0
// gives zeros), as keras_rec_emb/_jax/layers.py's combine_last_axis. With
// `prune`, ids < 0 are padding: never inserted nor counted, weight 0.
// With "mean" and "sqrtn" a weight <= 0 counts as 0 (layers.py has turned
// those ids into padding already). No [rows, L, dim] array of rows goes
// through XLA: an inference lookup combines the rows from the table
// (kv::Table::OrderedReader, as the TensorFlow pooled kernels do), a
// training one from a block buffer of the lookup that inserts. The
// backward (ApplyPooled) feeds id (r, k) w[r, k] / denominator(r) times
// grads[r] to the fused sparse apply.

// The combiners are kre::Combiner (core/pooled_rows.h), as the
// TensorFlow kernels'.

ffi::ErrorOr<Combiner> ParseCombinerAttr(std::string_view name) {
  if (name == "sum") return kSum;
  if (name == "mean") return kMean;
  if (name == "sqrtn") return kSqrtn;
  return ffi::Unexpected(
      Invalid("`combiner` must be sum, mean or sqrtn, got '" + string(name) + "'"));
}

// Checks ids [rows, L] and weights ([rows, L], or empty: none).
ffi::Error CheckPooled(const ffi::AnyBuffer& keys, const ffi::Buffer<ffi::F32>& weights) {
  const auto kd = keys.dimensions();
  if (kd.size() != 2) return Invalid("`keys` must be [rows, L], got " + Shape(kd));
  const auto wd = weights.dimensions();
  if (weights.element_count() != 0 && !(wd.size() == 2 && wd[0] == kd[0] && wd[1] == kd[1])) {
    return Invalid("`weights` must be empty or have the keys' shape " + Shape(kd) + ", got " +
                   Shape(wd));
  }
  return ffi::Error::Success();
}

// The ids a pooled call looks up (all, or with `prune` those >= 0), in
// batch order, each with its output row and weight, and each row's
// 1 / denominator.
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
      : inv(rows), len_(len), prune_(prune), combiner_(combiner) {
    keys.reserve(rows * len);
    row.reserve(rows * len);
    w.reserve(rows * len);
  }
  // Row r's ids k[0..len) and weights (or nullptr).
  void AddRow(int64_t r, const K* k, const float* weights) {
    float denom = 0;
    for (int64_t j = 0; j < len_; ++j) {
      if (prune_ && k[j] < 0) continue;
      float x = weights == nullptr ? 1.0f : weights[j];
      if (combiner_ != kSum && !(x > 0)) x = 0.0f;
      keys.push_back(k[j]);
      row.push_back(static_cast<int32_t>(r));
      w.push_back(x);
      denom += combiner_ == kSqrtn ? x * x : x;
    }
    if (combiner_ == kSqrtn) denom = std::sqrt(denom);
    inv[r] = combiner_ == kSum ? 1.0f : denom > 0 ? 1.0f / denom : 0.0f;
  }
  int64_t size() const { return static_cast<int64_t>(keys.size()); }

  std::vector<K> keys;
  std::vector<int32_t> row;
  std::vector<float> w, inv;

 private:
  const int64_t len_;
  const bool prune_;
  const Combiner combiner_;
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
    switch (dim_) {
      case 4:
        return AddFixed<4>(row, w, src, n);
      case 8:
        return AddFixed<8>(row, w, src, n);
      case 16:
        return AddFixed<16>(row, w, src, n);
      case 32:
        return AddFixed<32>(row, w, src, n);
      case 64:
        return AddFixed<64>(row, w, src, n);
      default:
        return AddFixed<0>(row, w, src, n);
    }
  }

  void Finish() {
    Store(acc_.data());
    Zero(rows_);
  }

 private:
  // D > 0: rows of D floats, the sum in a local array (registers); D = 0:
  // of dim_ floats, in acc_.
  template <int D>
  void AddFixed(const int32_t* row, const float* w, const float* const* src, int64_t n) {
    const int64_t dim = D > 0 ? D : dim_;
    float local[D > 0 ? D : 1];
    float* acc = D > 0 ? local : acc_.data();
    if (D > 0) std::copy(acc_.begin(), acc_.end(), acc);
    for (int64_t i = 0; i < n; ++i) {
      if (row[i] != cur_) {
        Store(acc);
        Zero(row[i]);
        cur_ = row[i];
        std::fill(acc, acc + dim, 0.0f);
      }
      const float s = w[i];
      const float* r = src[i];
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
// hash and count, grouped by shard (a counting sort) for
// kv::Table::LookupCounted, and the index of every id among them: a
// training lookup reads each distinct id once, counted as often as it
// occurs (as the TensorFlow group op does), instead of once per occurrence.
template <typename K>
struct DistinctIds {
  // The distinct ids of k[0..n).
  DistinctIds(const kv::Table<K>& table, const K* k, int64_t n) : inverse(n) {
    kv::BatchGroups groups(n);
    uniq.reserve(n);
    hashes.reserve(n);
    counts.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t h = kv::Table<K>::Hash(k[i]);
      bool created;
      const int64_t u = groups.Group(h, [&](int64_t g) { return uniq[g] == k[i]; }, &created);
      if (created) {
        uniq.push_back(k[i]);
        hashes.push_back(h);
        counts.push_back(0);
      }
      inverse[i] = u;
      ++counts[u];
    }
    GroupByShard(table);
  }
  // Ids known to be distinct (no counts, no inverse): for an update.
  DistinctIds(const kv::Table<K>& table, const K* distinct, int64_t m, bool /*distinct*/)
      : uniq(distinct, distinct + m), hashes(m) {
    for (int64_t u = 0; u < m; ++u) hashes[u] = kv::Table<K>::Hash(uniq[u]);
    GroupByShard(table);
  }
  int64_t size() const { return static_cast<int64_t>(uniq.size()); }

  // Looks every distinct id up once: row u of `rows` ([size(), dim]) is
  // uniq[u]'s.
  void Lookup(kv::Table<K>& table, bool insert, float* rows) const {
    for (int s = 0; s < table.num_shards(); ++s) {
      const int64_t b = offsets[s];
      if (offsets[s + 1] == b) continue;
      table.LookupCounted(s, keys.data() + b, part_hashes.data() + b, order.data() + b,
                          counts.data(), offsets[s + 1] - b, insert, rows);
    }
  }

  std::vector<K> uniq;
  std::vector<uint64_t> hashes;
  std::vector<int32_t> counts;
  std::vector<int64_t> inverse;
  // By shard: shard s holds keys[offsets[s], offsets[s + 1]), key j being
  // uniq[order[j]].
  std::vector<int64_t> offsets;
  std::vector<K> keys;
  std::vector<uint64_t> part_hashes;
  std::vector<int64_t> order;

 private:
  void GroupByShard(const kv::Table<K>& table) {
    const int shards = table.num_shards();
    const int64_t m = size();
    offsets.assign(shards + 1, 0);
    std::vector<int32_t> shard_of(m);
    for (int64_t u = 0; u < m; ++u) {
      shard_of[u] = table.ShardOf(hashes[u]);
      ++offsets[shard_of[u] + 1];
    }
    for (int s = 0; s < shards; ++s) offsets[s + 1] += offsets[s];
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    keys.resize(m);
    part_hashes.resize(m);
    order.resize(m);
    for (int64_t u = 0; u < m; ++u) {
      const int64_t j = next[shard_of[u]]++;
      keys[j] = uniq[u];
      part_hashes[j] = hashes[u];
      order[j] = u;
    }
  }
};

// A training pooled lookup through the distinct ids `d` of p's ids.
template <typename K>
void PooledLookupDistinctRows(kv::Table<K>& table, const PooledIds<K>& p, const DistinctIds<K>& d,
                              float* out, int64_t rows, int64_t out_stride = -1) {
  const int64_t dim = table.dim(), n = p.size();
  RowSums sums(out, p.inv.data(), rows, dim, out_stride);
  std::vector<float> buffer(d.size() * dim);
  d.Lookup(table, /*insert=*/true, buffer.data());
  std::vector<const float*> ptrs(n);
  for (int64_t i = 0; i < n; ++i) ptrs[i] = buffer.data() + d.inverse[i] * dim;
  sums.Add(p.row.data(), p.w.data(), ptrs.data(), n);
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

// The checks of a pooled lookup's operands (keys [rows, L], weights, `out`
// [rows, dim]); returns its combiner.
ffi::ErrorOr<Combiner> CheckPooledLookup(AnyTable& at, ffi::AnyBuffer keys,
                                         ffi::Buffer<ffi::F32> weights,
                                         ffi::Buffer<ffi::F32, 2> out, std::string_view combiner) {
  if (ffi::Error e = CheckKeys(at, keys); e.failure()) return ffi::Unexpected(e);
  if (ffi::Error e = CheckPooled(keys, weights); e.failure()) return ffi::Unexpected(e);
  auto comb = ParseCombinerAttr(combiner);
  if (comb.has_error()) return comb;
  const int64_t rows = keys.dimensions()[0];
  if (out.dimensions()[0] != rows || out.dimensions()[1] != at.dim()) {
    return ffi::Unexpected(Invalid("`out` must be [" + std::to_string(rows) + ", " +
                                   std::to_string(at.dim()) + "], got " + Shape(out.dimensions())));
  }
  return comb;
}

ffi::Error PooledLookup(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                        ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 2> out, int64_t table,
                        bool insert, bool prune, std::string_view combiner) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    auto comb = CheckPooledLookup(at, keys, weights, *out, combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = keys.dimensions()[0], len = keys.dimensions()[1];
    const float* w = weights.element_count() == 0 ? nullptr : weights.typed_data();
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
    const float* w = weights.element_count() == 0 ? nullptr : weights.typed_data();
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

ffi::Error ApplyPooled(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::F32, 2> grads, ffi::Buffer<ffi::F32> hyper,
                       ffi::AnyBuffer step, ffi::Result<ffi::Token>, int64_t table,
                       std::string_view rule_name, std::string_view hparam_names,
                       std::string_view slot_names, bool prune, std::string_view combiner) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (ffi::Error e = CheckPooled(keys, weights); e.failure()) return e;
    auto comb = ParseCombinerAttr(combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = keys.dimensions()[0], len = keys.dimensions()[1], dim = at.dim();
    if (grads.dimensions()[0] != rows || grads.dimensions()[1] != dim) {
      return Invalid("`grads` must be [" + std::to_string(rows) + ", " + std::to_string(dim) +
                     "], got " + Shape(grads.dimensions()));
    }
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const string rule(rule_name);
    const std::vector<string> hparams = SplitNames(hparam_names);
    const std::vector<string> slots = SplitNames(slot_names);
    const float* w = weights.element_count() == 0 ? nullptr : weights.typed_data();
    ffi::Error result = Invalid("unknown rule '" + rule + "'");
    rules::WithRule(rule, [&](auto tag) {
      using Rule = typename decltype(tag)::type;
      const string names_error = rules::CheckNames<Rule>(rule, hparams, slots);
      if (!names_error.empty()) {
        result = Invalid(names_error);
        return;
      }
      result = at.Visit([&](auto& tab) {
        using K = KeyOfT<decltype(tab)>;
        const PooledIds<K> p(keys.reinterpret_data<K>(), w, rows, len, prune, *comb);
        // Each id's gradient is made where the apply reads it
        // (DistinctRows copies or adds it at once).
        std::vector<float> one(dim);
        const float* g = grads.typed_data();
        auto grad_of = [&](int64_t i) {
          const int32_t r = p.row[i];
          const float s = p.w[i] * p.inv[r];
          const float* src = g + static_cast<int64_t>(r) * dim;
          for (int64_t d = 0; d < dim; ++d) one[d] = s * src[d];
          return static_cast<const float*>(one.data());
        };
        return ApplyRule<Rule>(tab, rule, slots, p.keys.data(), p.size(), grad_of,
                               hyper.dimensions(), hyper.typed_data(), *version);
      });
    });
    return result;
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
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
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
    const float* w = weights.element_count() == 0 ? nullptr : weights.typed_data();
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

// The backward of PooledLookupDistinct: id (r, k)'s share of row r's
// gradient, w[r, k] / denominator(r) * grads[r] (as ApplyPooled), summed
// per distinct id through `inverse` in batch order, then each distinct id
// updated once, shard by shard in first-seen order: the same sums, order
// and updates as ApplyPooled of the same ids.
ffi::Error ApplyDistinct(ffi::Token, ffi::AnyBuffer distinct, ffi::AnyBuffer count,
                         ffi::Buffer<ffi::S32, 2> inverse, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::F32, 2> grads, ffi::Buffer<ffi::F32> hyper,
                         ffi::AnyBuffer step, ffi::Result<ffi::Token>, int64_t table,
                         std::string_view rule_name, std::string_view hparam_names,
                         std::string_view slot_names, std::string_view combiner) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    if (ffi::Error e = CheckKeys(at, distinct); e.failure()) return e;
    auto comb = ParseCombinerAttr(combiner);
    if (comb.has_error()) return comb.error();
    const int64_t rows = inverse.dimensions()[0], len = inverse.dimensions()[1], dim = at.dim();
    const auto wd = weights.dimensions();
    if (weights.element_count() != 0 && !(wd.size() == 2 && wd[0] == rows && wd[1] == len)) {
      return Invalid("`weights` must be empty or have the inverse's shape " +
                     Shape(inverse.dimensions()) + ", got " + Shape(wd));
    }
    if (grads.dimensions()[0] != rows || grads.dimensions()[1] != dim) {
      return Invalid("`grads` must be [" + std::to_string(rows) + ", " + std::to_string(dim) +
                     "], got " + Shape(grads.dimensions()));
    }
    auto m = IntScalar(count, "count");
    if (m.has_error()) return m.error();
    if (*m < 0 || *m > static_cast<int64_t>(distinct.element_count())) {
      return Invalid("`count` must be in [0, " + std::to_string(distinct.element_count()) +
                     "], got " + std::to_string(*m));
    }
    auto version = IntScalar(step, "step");
    if (version.has_error()) return version.error();
    const int32_t* inv = inverse.typed_data();
    const float* w = weights.element_count() == 0 ? nullptr : weights.typed_data();
    const float* g = grads.typed_data();
    std::vector<float> sums(*m * dim, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float denom = 0;
      for (int64_t j = r * len; j < (r + 1) * len; ++j) {
        if (inv[j] < -1 || inv[j] >= *m) {
          return Invalid("`inverse` must be in [-1, count = " + std::to_string(*m) + "), got " +
                         std::to_string(inv[j]));
        }
        if (inv[j] < 0) continue;
        float x = w == nullptr ? 1.0f : w[j];
        if (*comb != kSum && !(x > 0)) x = 0.0f;
        denom += *comb == kSqrtn ? x * x : x;
      }
      if (*comb == kSqrtn) denom = std::sqrt(denom);
      const float c = *comb == kSum ? 1.0f : denom > 0 ? 1.0f / denom : 0.0f;
      const float* src = g + r * dim;
      for (int64_t j = r * len; j < (r + 1) * len; ++j) {
        if (inv[j] < 0) continue;
        float x = w == nullptr ? 1.0f : w[j];
        if (*comb != kSum && !(x > 0)) x = 0.0f;
        const float s = x * c;
        float* acc = sums.data() + static_cast<int64_t>(inv[j]) * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += s * src[d];
      }
    }
    const string rule(rule_name);
    const std::vector<string> hparams = SplitNames(hparam_names);
    const std::vector<string> slots = SplitNames(slot_names);
    ffi::Error result = Invalid("unknown rule '" + rule + "'");
    rules::WithRule(rule, [&](auto tag) {
      using Rule = typename decltype(tag)::type;
      const string names_error = rules::CheckNames<Rule>(rule, hparams, slots);
      if (!names_error.empty()) {
        result = Invalid(names_error);
        return;
      }
      result = at.Visit([&](auto& tab) -> ffi::Error {
        using K = KeyOfT<decltype(tab)>;
        auto checked = RuleSlots<Rule>(tab, rule, slots, hyper.dimensions(), hyper.typed_data());
        if (checked.has_error()) return checked.error();
        const DistinctIds<K> d(tab, distinct.reinterpret_data<K>(), *m, /*distinct=*/true);
        const rules::ApplyRow<Rule> update(hyper.typed_data(), dim);
        for (int s = 0; s < tab.num_shards(); ++s) {
          const int64_t b = d.offsets[s];
          if (d.offsets[s + 1] == b) continue;
          tab.ApplyDistinct(s, d.keys.data() + b, d.part_hashes.data() + b, d.order.data() + b,
                            d.offsets[s + 1] - b, sums.data(), *checked, *version, update);
        }
        return ffi::Error::Success();
      });
    });
    return result;
  });
}

// --- size / export ------------------------------------------------------------

// out: [size, filtered size, total slot width, number of slots].
// Exports the admitted keys into outputs of `capacity` rows (their first
// dimension): keys, values [capacity, dim], freqs, versions, slots
// [capacity, total slot width] (slot columns in slot order), and `count`,
// the number of admitted keys. When count > capacity nothing is written
// (the caller asks again with a larger capacity); rows past count are
// left as they are.
ffi::Error Export(ffi::Token, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> keys,
                  ffi::ResultBuffer<ffi::F32, 2> values, ffi::Result<ffi::AnyBuffer> freqs,
                  ffi::Result<ffi::AnyBuffer> versions, ffi::ResultBuffer<ffi::F32, 2> slots,
                  ffi::Result<ffi::AnyBuffer> count, int64_t table) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    const ffi::DataType key_type = at.key_bits() == 64 ? ffi::DataType::S64 : ffi::DataType::S32;
    const auto kd = keys->dimensions();
    if (kd.size() != 1 || keys->element_type() != key_type) {
      return Invalid("the keys output must be a vector of " + DtypeName(key_type));
    }
    const int64_t capacity = kd[0];
    const int64_t dim = at.dim();
    if (values->dimensions()[0] != capacity || values->dimensions()[1] != dim) {
      return Invalid("the values output must be [capacity, dim] = [" + std::to_string(capacity) +
                     ", " + std::to_string(dim) + "], got " + Shape(values->dimensions()));
    }
    for (const ffi::AnyBuffer& b : {*freqs, *versions}) {
      if (!IsInt(b) || b.dimensions().size() != 1 || b.dimensions()[0] != capacity) {
        return Invalid("the freqs and versions outputs must be int vectors of " +
                       std::to_string(capacity));
      }
    }
    if (!IsInt(*count) || count->element_count() != 1) {
      return Invalid("the count output must be an int scalar");
    }
    return at.Visit([&](auto& tab) -> ffi::Error {
      using K = KeyOfT<decltype(tab)>;
      int64_t width = 0;
      for (const auto& s : tab.Slots()) width += s.width;
      if (slots->dimensions()[0] != capacity || slots->dimensions()[1] != width) {
        return Invalid("the slots output must be [capacity, total slot width] = [" +
                       std::to_string(capacity) + ", " + std::to_string(width) + "], got " +
                       Shape(slots->dimensions()));
      }
      std::vector<int64_t> f, v;
      std::vector<K> skip_keys;
      std::vector<int64_t> skip_freqs, skip_versions;
      int64_t exported = -1;
      tab.Export([&](int64_t n, int64_t nf) -> std::optional<typename kv::Table<K>::ExportBuffers> {
        SetInt(*count, 0, n);
        if (n > capacity) return std::nullopt;
        exported = n;
        f.resize(n);
        v.resize(n);
        skip_keys.resize(nf);
        skip_freqs.resize(nf);
        skip_versions.resize(nf);
        return typename kv::Table<K>::ExportBuffers{keys->reinterpret_data<K>(),
                                                    values->typed_data(),
                                                    f.data(),
                                                    v.data(),
                                                    slots->typed_data(),
                                                    skip_keys.data(),
                                                    skip_freqs.data(),
                                                    skip_versions.data()};
      });
      for (int64_t i = 0; i < exported; ++i) {
        SetInt(*freqs, i, f[i]);
        SetInt(*versions, i, v[i]);
      }
      return ffi::Error::Success();
    });
  });
}

// --- save and restore (the parts of a .keras file) ----------------------------
//
// The TensorFlow backend's EmbeddingVariable saves every part of
// keras_rec_emb/variables.py's PARTS; these handlers give the JAX binding
// the parts Export lacks (initializer matrix, Bloom counters, keys counted
// but not admitted) and the import that restores all of them.

// Element i of an int32 or int64 vector.
int64_t IntAt(const ffi::AnyBuffer& b, int64_t i) {
  if (b.element_type() == ffi::DataType::S64) return b.reinterpret_data<int64_t>()[i];
  return b.reinterpret_data<int32_t>()[i];
}

// Checks that `b` is an int32 or int64 vector of `n` elements (n < 0: any).
ffi::Error CheckIntVector(const ffi::AnyBuffer& b, const char* name, int64_t n) {
  if (!IsInt(b) || b.dimensions().size() != 1 || (n >= 0 && b.dimensions()[0] != n)) {
    return Invalid(string("`") + name + "` must be an int32 or int64 vector" +
                   (n >= 0 ? " of " + std::to_string(n) + " elements" : string()) + ", got " +
                   DtypeName(b.element_type()) + " " + Shape(b.dimensions()));
  }
  return ffi::Error::Success();
}

// Checks that `b` is a float32 matrix [rows, cols] (rows < 0: any).
ffi::Error CheckMatrix(ffi::Span<const int64_t> dims, const char* name, int64_t rows,
                       int64_t cols) {
  if (dims.size() != 2 || (rows >= 0 && dims[0] != rows) || dims[1] != cols) {
    return Invalid(string("`") + name + "` must be float32 [" +
                   (rows >= 0 ? std::to_string(rows) : string("rows")) + ", " +
                   std::to_string(cols) + "], got " + Shape(dims));
  }
  return ffi::Error::Success();
}

// The keys of `b` as K, or an error naming a duplicate.
template <typename K>
ffi::ErrorOr<std::vector<K>> UniqueKeys(const ffi::AnyBuffer& b, const char* name) {
  const int64_t n = static_cast<int64_t>(b.element_count());
  const K* k = b.reinterpret_data<K>();
  std::vector<K> sorted(k, k + n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    return ffi::Unexpected(Invalid(string("`") + name + "` holds key " + std::to_string(*dup) +
                                   " twice; each key must appear once"));
  }
  return std::vector<K>(k, k + n);
}

std::vector<int64_t> IntVector(const ffi::AnyBuffer& b) {
  std::vector<int64_t> out(b.element_count());
  for (size_t i = 0; i < out.size(); ++i) out[i] = IntAt(b, static_cast<int64_t>(i));
  return out;
}

ffi::Error CheckFinite(const float* v, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) {
      return Invalid(string("`") + name + "` must be finite, got " + std::to_string(v[i]) +
                     " at flat index " + std::to_string(i));
    }
  }
  return ffi::Error::Success();
}

// out: [default_value_dim, Bloom counter bytes, keys counted but not admitted].
ffi::Error SaveInfo(ffi::Token, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                    int64_t table) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    if (!IsInt(*out) || out->element_count() != 3) {
      return Invalid("the save-info output must be 3 int32 or int64 values");
    }
    (*t)->Visit([&](auto& tab) {
      SetInt(*out, 0, tab.default_value_dim());
      SetInt(*out, 1, static_cast<int64_t>(tab.BloomStateBytes()));
      SetInt(*out, 2, tab.FilteredSize());
    });
    return ffi::Error::Success();
  });
}

// The initializer matrix [default_value_dim, dim], the Bloom counters, and
// the keys counted but not admitted with their frequencies and versions, in
// outputs of `capacity` rows; `count` is their number (when it exceeds the
// capacity nothing of them is written: the caller asks again). With
// filtered keys to write, the admitted rows are read into scratch memory
// and dropped (Export already returns them).
ffi::Error ExportAux(ffi::Token, ffi::Result<ffi::Token>, ffi::ResultBuffer<ffi::F32, 2> defaults,
                     ffi::ResultBuffer<ffi::U8, 1> bloom, ffi::Result<ffi::AnyBuffer> keys_f,
                     ffi::Result<ffi::AnyBuffer> freqs_f, ffi::Result<ffi::AnyBuffer> versions_f,
                     ffi::Result<ffi::AnyBuffer> count, int64_t table) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    const ffi::DataType key_type = at.key_bits() == 64 ? ffi::DataType::S64 : ffi::DataType::S32;
    if (keys_f->dimensions().size() != 1 || keys_f->element_type() != key_type) {
      return Invalid("the keys_filtered output must be a vector of " + DtypeName(key_type));
    }
    const int64_t capacity = keys_f->dimensions()[0];
    for (const ffi::AnyBuffer& b : {*freqs_f, *versions_f}) {
      if (!IsInt(b) || b.dimensions().size() != 1 || b.dimensions()[0] != capacity) {
        return Invalid("the freqs_filtered and versions_filtered outputs must be int vectors of " +
                       std::to_string(capacity));
      }
    }
    if (!IsInt(*count) || count->element_count() != 1) {
      return Invalid("the count output must be an int scalar");
    }
    return at.Visit([&](auto& tab) -> ffi::Error {
      using K = KeyOfT<decltype(tab)>;
      const std::vector<float> d = tab.DefaultValues();
      const size_t bloom_bytes = tab.BloomStateBytes();
      const int64_t dim = tab.dim();
      if (d.size() != defaults->element_count() || defaults->dimensions()[1] != dim) {
        return Invalid("the default_values output must be [" +
                       std::to_string(static_cast<int64_t>(d.size()) / dim) + ", " +
                       std::to_string(dim) + "], got " + Shape(defaults->dimensions()));
      }
      if (bloom_bytes != bloom->element_count()) {
        return Invalid("the bloom output must have " + std::to_string(bloom_bytes) +
                       " bytes, got " + Shape(bloom->dimensions()));
      }
      std::copy(d.begin(), d.end(), defaults->typed_data());
      tab.CopyBloomState(bloom->typed_data());
      if (capacity == 0) {
        // Without keys counted but not admitted (a table without a filter)
        // the rows are not read; with some, the caller asks again.
        SetInt(*count, 0, tab.FilteredSize());
        return ffi::Error::Success();
      }
      int64_t width = 0;
      for (const auto& s : tab.Slots()) width += s.width;
      std::vector<K> k, kf;
      std::vector<float> values, slots;
      std::vector<int64_t> f, v, ff, vf;
      int64_t exported = -1;
      tab.Export([&](int64_t n, int64_t nf) -> std::optional<typename kv::Table<K>::ExportBuffers> {
        SetInt(*count, 0, nf);
        if (nf > capacity) return std::nullopt;
        exported = nf;
        k.resize(n);
        values.resize(n * dim);
        slots.resize(n * width);
        f.resize(n);
        v.resize(n);
        ff.resize(nf);
        vf.resize(nf);
        return typename kv::Table<K>::ExportBuffers{k.data(),     values.data(),
                                                    f.data(),     v.data(),
                                                    slots.data(), keys_f->reinterpret_data<K>(),
                                                    ff.data(),    vf.data()};
      });
      for (int64_t i = 0; i < exported; ++i) {
        SetInt(*freqs_f, i, ff[i]);
        SetInt(*versions_f, i, vf[i]);
      }
      return ffi::Error::Success();
    });
  });
}

// Replaces the contents of the table with the parts of a saved table (see
// keras_rec_emb/variables.py's PARTS): admitted keys with rows, frequencies,
// versions and slot columns (`slot_values`, blocks of `slot_widths` columns
// for the comma-joined `slot_names`; a slot the table lacks is added), the
// initializer matrix (kept when `default_values` has no rows), the keys
// counted but not admitted, and the Bloom counters (kept when empty).
// Every part is checked first; the new contents are built beside the table
// and swapped in, so a failed import leaves the table as it was.
ffi::Error Import(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> values,
                  ffi::AnyBuffer freqs, ffi::AnyBuffer versions, ffi::Buffer<ffi::F32> slot_values,
                  ffi::AnyBuffer slot_widths, ffi::Buffer<ffi::F32> default_values,
                  ffi::AnyBuffer keys_filtered, ffi::AnyBuffer freqs_filtered,
                  ffi::AnyBuffer versions_filtered, ffi::Buffer<ffi::U8> bloom,
                  ffi::Result<ffi::Token>, int64_t table, std::string_view slot_names) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    const int64_t dim = at.dim();
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (ffi::Error e = CheckKeys(at, keys_filtered); e.failure()) {
      return Invalid("`keys_filtered`: " + e.message());
    }
    if (keys.dimensions().size() != 1 || keys_filtered.dimensions().size() != 1) {
      return Invalid("`keys` and `keys_filtered` must be vectors, got " + Shape(keys.dimensions()) +
                     " and " + Shape(keys_filtered.dimensions()));
    }
    const int64_t n = keys.dimensions()[0];
    const int64_t nf = keys_filtered.dimensions()[0];
    if (ffi::Error e = CheckMatrix(values.dimensions(), "values", n, dim); e.failure()) return e;
    for (auto [b, name, rows] : {std::tuple{&freqs, "freqs", n},
                                 {&versions, "versions", n},
                                 {&freqs_filtered, "freqs_filtered", nf},
                                 {&versions_filtered, "versions_filtered", nf}}) {
      if (ffi::Error e = CheckIntVector(*b, name, rows); e.failure()) return e;
    }
    const std::vector<string> names = SplitNames(slot_names);
    if (ffi::Error e = CheckIntVector(slot_widths, "slot_widths", -1); e.failure()) return e;
    const std::vector<int64_t> widths = IntVector(slot_widths);
    if (widths.size() != names.size()) {
      return Invalid("`slot_names` and `slot_widths` must have one length, got " +
                     std::to_string(names.size()) + " and " + std::to_string(widths.size()));
    }
    int64_t total = 0;
    for (size_t j = 0; j < names.size(); ++j) {
      if (names[j].empty()) return Invalid("`slot_names` must not hold an empty name");
      if (std::count(names.begin(), names.end(), names[j]) > 1) {
        return Invalid("`slot_names` holds '" + names[j] + "' twice");
      }
      if (widths[j] < 1 || widths[j] > (int64_t{1} << 20)) {
        return Invalid("`slot_widths` must be in [1, 2**20], got " + std::to_string(widths[j]) +
                       " for slot '" + names[j] + "'");
      }
      total += widths[j];
    }
    if (ffi::Error e = CheckMatrix(slot_values.dimensions(), "slot_values", n, total);
        e.failure()) {
      return e;
    }
    if (ffi::Error e = CheckMatrix(default_values.dimensions(), "default_values", -1, dim);
        e.failure()) {
      return e;
    }
    if (bloom.dimensions().size() != 1) {
      return Invalid("`bloom` must be a uint8 vector, got " + Shape(bloom.dimensions()));
    }
    if (ffi::Error e = CheckFinite(values.typed_data(), n * dim, "values"); e.failure()) return e;
    if (ffi::Error e = CheckFinite(slot_values.typed_data(), n * total, "slot_values");
        e.failure()) {
      return e;
    }
    const std::vector<int64_t> f = IntVector(freqs), v = IntVector(versions);
    const std::vector<int64_t> ff = IntVector(freqs_filtered), vf = IntVector(versions_filtered);
    for (auto [counts, name] : {std::pair{&f, "freqs"}, {&ff, "freqs_filtered"}}) {
      const auto negative =
          std::find_if(counts->begin(), counts->end(), [](int64_t c) { return c < 0; });
      if (negative != counts->end()) {
        return Invalid(string("`") + name + "` must be >= 0, got " + std::to_string(*negative));
      }
    }
    return at.Visit([&](auto& tab) -> ffi::Error {
      using K = KeyOfT<decltype(tab)>;
      auto k = UniqueKeys<K>(keys, "keys");
      if (k.has_error()) return k.error();
      auto kf = UniqueKeys<K>(keys_filtered, "keys_filtered");
      if (kf.has_error()) return kf.error();
      const std::vector<kv::SlotSpec> specs = tab.Slots();
      for (size_t j = 0; j < names.size(); ++j) {
        for (const auto& spec : specs) {
          if (spec.name == names[j] && spec.width != widths[j]) {
            return Invalid("slot '" + spec.name + "' has width " + std::to_string(spec.width) +
                           " in the table but " + std::to_string(widths[j]) + " in `slot_widths`");
          }
        }
      }
      const int64_t bloom_bytes = static_cast<int64_t>(tab.BloomStateBytes());
      if (bloom.element_count() != 0 &&
          static_cast<int64_t>(bloom.element_count()) != bloom_bytes) {
        return Invalid("`bloom` has " + std::to_string(bloom.element_count()) +
                       " bytes but this table's counting Bloom filter has " +
                       std::to_string(bloom_bytes) + "; it was saved with other filter settings");
      }
      kv::TableOptions options = tab.options();
      options.default_values = tab.DefaultValues();
      options.storage_lock = false;  // a staging table beside the live one
      kv::Table<K> staging(std::move(options));
      for (const auto& spec : specs) staging.AddSlot(spec.name, spec.width, spec.init);
      std::vector<int> ids;
      for (size_t j = 0; j < names.size(); ++j) {
        const int id = staging.SlotIndex(names[j]);
        ids.push_back(id >= 0 ? id : staging.AddSlot(names[j], widths[j], 0.0f));
      }
      if (default_values.dimensions()[0] > 0) {
        const float* d = default_values.typed_data();
        staging.SetDefaultValues(std::vector<float>(d, d + default_values.element_count()));
      }
      staging.Import(k->data(), values.typed_data(), f.data(), v.data(), n,
                     slot_values.typed_data(), ids, widths);
      staging.ImportFiltered(kf->data(), ff.data(), vf.data(), nf);
      if (bloom.element_count() != 0 &&
          !staging.SetBloomState(bloom.typed_data(), bloom.element_count())) {
        return Invalid("`bloom` is not a counting Bloom filter state of this table's settings");
      }
      // A slot of the saved table the live table lacks is added to the live
      // table first (SwapContents needs the live table's slots in staging).
      for (size_t j = 0; j < names.size(); ++j) {
        if (tab.SlotIndex(names[j]) < 0) tab.AddSlot(names[j], widths[j], 0.0f);
      }
      tab.SwapContents(staging);
      return ffi::Error::Success();
    });
  });
}

// Writes rows into the live table (TensorFlow's `merge_rows`, which
// AdaptiveEmbedding's promotion copies static rows with): for each i with
// mask[i] != 0, key i gets row `values[i]`, inserted and admitted if absent
// (past any filter), its frequency set to freqs[i] (-1 keeps the count of a
// key admitted or counted; 0 for a new one) and its version to the table's latest step
// (0 before any). Other keys, slots and filter state are unchanged. Shapes
// are fixed under jit, so `mask` marks the entries that count; a key
// marked twice takes its last row.
ffi::Error Merge(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> values,
                 ffi::AnyBuffer freqs, ffi::AnyBuffer mask, ffi::Result<ffi::Token>,
                 int64_t table) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(table);
    if (t.has_error()) return t.error();
    AnyTable& at = **t;
    if (ffi::Error e = CheckKeys(at, keys); e.failure()) return e;
    if (keys.dimensions().size() != 1) {
      return Invalid("`keys` must be a vector, got " + Shape(keys.dimensions()));
    }
    const int64_t n = keys.dimensions()[0];
    if (ffi::Error e = CheckMatrix(values.dimensions(), "values", n, at.dim()); e.failure()) {
      return e;
    }
    if (ffi::Error e = CheckIntVector(freqs, "freqs", n); e.failure()) return e;
    if (ffi::Error e = CheckIntVector(mask, "mask", n); e.failure()) return e;
    std::vector<int64_t> kept;
    for (int64_t i = 0; i < n; ++i) {
      if (IntAt(mask, i) != 0) kept.push_back(i);
    }
    const int64_t m = static_cast<int64_t>(kept.size());
    const int64_t dim = at.dim();
    std::vector<float> rows(m * dim);
    std::vector<int64_t> f(m);
    for (int64_t j = 0; j < m; ++j) {
      const float* src = values.typed_data() + kept[j] * dim;
      std::copy(src, src + dim, rows.begin() + j * dim);
      f[j] = std::max<int64_t>(IntAt(freqs, kept[j]), -1);
    }
    if (ffi::Error e = CheckFinite(rows.data(), m * dim, "values"); e.failure()) return e;
    return at.Visit([&](auto& tab) -> ffi::Error {
      using K = KeyOfT<decltype(tab)>;
      const K* k = keys.reinterpret_data<K>();
      std::vector<K> ks(m);
      for (int64_t j = 0; j < m; ++j) ks[j] = k[kept[j]];
      const std::vector<int64_t> v(m, std::max<int64_t>(tab.LatestStep(), 0));
      tab.Import(ks.data(), rows.data(), f.data(), v.data(), m, nullptr, {}, {});
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jaxbind
}  // namespace kre

// The handlers' C symbols, which keras_rec_emb/_jax/ffi.py registers with
// jax.ffi.register_ffi_target (with table_host.cc's functions, the only
// symbols the library exports).
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableLookup, kre::jaxbind::Lookup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("table")
                                  .Attr<bool>("insert")
                                  .Attr<bool>("prune"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableApply, kre::jaxbind::Apply,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("table")
                                  .Attr<std::string_view>("rule")
                                  .Attr<std::string_view>("hparam_names")
                                  .Attr<std::string_view>("slots")
                                  .Attr<bool>("prune"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTablePooledLookup, kre::jaxbind::PooledLookup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Attr<int64_t>("table")
                                  .Attr<bool>("insert")
                                  .Attr<bool>("prune")
                                  .Attr<std::string_view>("combiner"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreGroupPooledLookup, kre::jaxbind::GroupPooledLookup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("tables")
                                  .Attr<std::string_view>("combiners")
                                  .Attr<bool>("prune"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableApplyPooled, kre::jaxbind::ApplyPooled,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("table")
                                  .Attr<std::string_view>("rule")
                                  .Attr<std::string_view>("hparam_names")
                                  .Attr<std::string_view>("slots")
                                  .Attr<bool>("prune")
                                  .Attr<std::string_view>("combiner"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTablePooledLookupDistinct, kre::jaxbind::PooledLookupDistinct,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Ret<ffi::BufferR2<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("table")
                                  .Attr<bool>("prune")
                                  .Attr<std::string_view>("combiner"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableApplyDistinct, kre::jaxbind::ApplyDistinct,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("table")
                                  .Attr<std::string_view>("rule")
                                  .Attr<std::string_view>("hparam_names")
                                  .Attr<std::string_view>("slots")
                                  .Attr<std::string_view>("combiner"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableExport, kre::jaxbind::Export,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("table"));

// Save and restore.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableSaveInfo, kre::jaxbind::SaveInfo,
    ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>().Ret<ffi::AnyBuffer>().Attr<int64_t>(
        "table"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableExportAux, kre::jaxbind::ExportAux,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::BufferR2<ffi::F32>>()
                                  .Ret<ffi::BufferR1<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("table"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableImport, kre::jaxbind::Import,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("table")
                                  .Attr<std::string_view>("slot_names"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableMerge, kre::jaxbind::Merge,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("table"));

#pragma GCC visibility pop
