// Copyright keras_rec_emb authors. Apache-2.0.
//
// What the XLA FFI handler families share: errors, the checks of their
// operands, the table of a handle, the plain lookup, and the dispatch to an
// update rule. The handlers themselves, by family: lookup_handlers.cc (the
// plain lookup), pooled_handlers.cc (the combiners' lookups),
// apply_handlers.cc (the sparse updates), saving_handlers.cc (export,
// import and the parts of a saved table).
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
#ifndef KRE_JAX_HANDLERS_H_
#define KRE_JAX_HANDLERS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/update_rules.h"
#include "jax/table_registry.h"
#include "kv/partition.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kre {
namespace jaxbind {

using std::string;

inline ffi::Error Invalid(const string& message) { return ffi::Error::InvalidArgument(message); }

inline ffi::Error Precondition(const string& message) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
}

inline string Shape(ffi::Span<const int64_t> dims) {
  string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

inline string DtypeName(ffi::DataType t) {
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

// The table of `handle` as it is, its deferred work maybe still pending (a
// caller settles it before use), or an error naming it.
inline ffi::ErrorOr<std::shared_ptr<AnyTable>> FindUnsettled(int64_t handle) {
  std::shared_ptr<AnyTable> t = Tables().Get(handle);
  if (t == nullptr) {
    return ffi::Unexpected(Invalid("no embedding table has handle " + std::to_string(handle) +
                                   " (it was destroyed, or made in another process)"));
  }
  return t;
}

// The table of `handle`, its deferred work settled (AnyTable::Settle, which
// rethrows that work's failure: call it inside Guarded), or an error naming
// it.
inline ffi::ErrorOr<std::shared_ptr<AnyTable>> Find(int64_t handle) {
  auto t = FindUnsettled(handle);
  if (t.has_value()) (*t)->Settle();
  return t;
}

// Whether an update's table part may run on XLA's intra-op pool after its
// handler returned (Defer): when the pool has threads to spare. One thread
// (NPROC=1, the pool's size) keeps every table call on the calling thread.
inline bool Deferrable(ffi::ThreadPool& pool) { return pool.num_threads() >= 2; }

// Runs `work` (the table part of an update of `table`, owning what it
// reads) on XLA's intra-op pool, or on the table's next use if that comes
// first (AnyTable::Defer).
template <typename Work>
void Defer(ffi::ThreadPool& pool, AnyTable& table, Work&& work) {
  table.Defer(std::forward<Work>(work));
  pool.Schedule([t = table.shared_from_this()] { t->RunDeferred(); });
}

// Runs fn(i) for i in [0, n) on the calling thread and, when XLA's pool
// has threads to spare (Deferrable), on pool threads too (ShareWork).
template <typename Fn>
void OnPool(ffi::ThreadPool& pool, int64_t n, Fn&& fn) {
  const int64_t helpers = Deferrable(pool) ? pool.num_threads() - 1 : 0;
  ShareWork(
      helpers, [&pool](auto&& task) { pool.Schedule(std::forward<decltype(task)>(task)); }, n,
      std::forward<Fn>(fn));
}

// Guarded body(table) on the table of `handle` (the error naming it when
// there is none).
template <typename Body>
ffi::Error OnTable(int64_t handle, Body&& body) {
  return Guarded([&]() -> ffi::Error {
    auto t = Find(handle);
    if (t.has_error()) return t.error();
    return body(**t);
  });
}

// The dtype of the table's keys (int32 or int64).
inline ffi::DataType KeyType(const AnyTable& table) {
  return table.key_bits() == 64 ? ffi::DataType::S64 : ffi::DataType::S32;
}

// Checks that `keys` has the key dtype of `table` (int32 or int64).
inline ffi::Error CheckKeys(const AnyTable& table, const ffi::AnyBuffer& keys) {
  const ffi::DataType want = KeyType(table);
  if (keys.element_type() != want) {
    return Invalid("the embedding table has " + DtypeName(want) + " keys but `keys` is " +
                   DtypeName(keys.element_type()) + "; cast the keys to the table's key dtype");
  }
  return ffi::Error::Success();
}

// Checks that `rows` has shape keys.shape + [dim].
inline ffi::Error CheckRows(ffi::Span<const int64_t> keys, ffi::Span<const int64_t> rows,
                            int64_t dim, const char* name) {
  bool ok = rows.size() == keys.size() + 1 && rows[keys.size()] == dim;
  for (size_t i = 0; ok && i < keys.size(); ++i) ok = rows[i] == keys[i];
  if (!ok) {
    return Invalid(string("`") + name + "` must have shape keys.shape + [dim] = " + Shape(keys) +
                   " + [" + std::to_string(dim) + "], got " + Shape(rows));
  }
  return ffi::Error::Success();
}

// Checks that the matrix `dims` is [rows, cols] (a message naming `name`).
inline ffi::Error CheckShape2(ffi::Span<const int64_t> dims, const char* name, int64_t rows,
                              int64_t cols, const string& what = string()) {
  if (dims[0] != rows || dims[1] != cols) {
    return Invalid(string("`") + name + "` must be [" + std::to_string(rows) + ", " +
                   std::to_string(cols) + "]" + what + ", got " + Shape(dims));
  }
  return ffi::Error::Success();
}

inline bool IsInt(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::S32 || b.element_type() == ffi::DataType::S64;
}

// A scalar int32 or int64 operand as int64.
inline ffi::ErrorOr<int64_t> IntScalar(const ffi::AnyBuffer& b, const char* name) {
  if (b.dimensions().size() != 0) {
    return ffi::Unexpected(
        Invalid(string("`") + name + "` must be a scalar, got shape " + Shape(b.dimensions())));
  }
  if (b.element_type() == ffi::DataType::S64) return *b.reinterpret_data<int64_t>();
  if (b.element_type() == ffi::DataType::S32) return *b.reinterpret_data<int32_t>();
  return ffi::Unexpected(
      Invalid(string("`") + name + "` must be int32 or int64, got " + DtypeName(b.element_type())));
}

// Element i of an int32 or int64 vector.
inline int64_t IntAt(const ffi::AnyBuffer& b, int64_t i) {
  if (b.element_type() == ffi::DataType::S64) return b.reinterpret_data<int64_t>()[i];
  return b.reinterpret_data<int32_t>()[i];
}

// An int32 or int64 vector as int64.
inline std::vector<int64_t> IntVector(const ffi::AnyBuffer& b) {
  std::vector<int64_t> out(b.element_count());
  for (size_t i = 0; i < out.size(); ++i) out[i] = IntAt(b, static_cast<int64_t>(i));
  return out;
}

// Writes `value` into integer output `b` (int32 or int64; an int32 output
// saturates).
inline void SetInt(ffi::AnyBuffer b, int64_t i, int64_t value) {
  if (b.element_type() == ffi::DataType::S64) {
    b.reinterpret_data<int64_t>()[i] = value;
  } else {
    const int64_t lo = std::numeric_limits<int32_t>::min();
    const int64_t hi = std::numeric_limits<int32_t>::max();
    b.reinterpret_data<int32_t>()[i] = static_cast<int32_t>(std::clamp(value, lo, hi));
  }
}

// Checks that `b` is an int32 or int64 vector of `n` elements (n < 0: any).
inline ffi::Error CheckIntVector(const ffi::AnyBuffer& b, const char* name, int64_t n) {
  if (!IsInt(b) || b.dimensions().size() != 1 || (n >= 0 && b.dimensions()[0] != n)) {
    return Invalid(string("`") + name + "` must be an int32 or int64 vector" +
                   (n >= 0 ? " of " + std::to_string(n) + " elements" : string()) + ", got " +
                   DtypeName(b.element_type()) + " " + Shape(b.dimensions()));
  }
  return ffi::Error::Success();
}

// Checks that `b` is a float32 matrix [rows, cols] (rows < 0: any).
inline ffi::Error CheckMatrix(ffi::Span<const int64_t> dims, const char* name, int64_t rows,
                              int64_t cols) {
  if (dims.size() != 2 || (rows >= 0 && dims[0] != rows) || dims[1] != cols) {
    return Invalid(string("`") + name + "` must be float32 [" +
                   (rows >= 0 ? std::to_string(rows) : string("rows")) + ", " +
                   std::to_string(cols) + "], got " + Shape(dims));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckFinite(const float* v, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) {
      return Invalid(string("`") + name + "` must be finite, got " + std::to_string(v[i]) +
                     " at flat index " + std::to_string(i));
    }
  }
  return ffi::Error::Success();
}

inline std::vector<string> SplitNames(std::string_view joined) {
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

// Weights of an optional operand: nullptr when it is empty (none).
inline const float* OptionalWeights(const ffi::Buffer<ffi::F32>& weights) {
  return weights.element_count() == 0 ? nullptr : weights.typed_data();
}

// Runs fn(s) for every shard of a batch partitioned by kv::Partition.
template <typename K>
kv::Partitioned<K> PartitionSerial(const kv::Table<K>& table, const K* keys, int64_t n) {
  return kv::Partition(table, keys, n, 1, [](int num_blocks, auto&& fn) {
    for (int b = 0; b < num_blocks; ++b) fn(b);
  });
}

// Looks keys[0..n) up (inserting them with `insert`) into out [n, dim].
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
// counted; their rows are zeros (and `Apply` skips them). The positions of
// the others.
template <typename K>
std::vector<int64_t> KeptPositions(const K* keys, int64_t n) {
  std::vector<int64_t> kept;
  kept.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] >= 0) kept.push_back(i);
  }
  return kept;
}

// keys at the positions `kept`.
template <typename K>
std::vector<K> KeysAt(const K* keys, const std::vector<int64_t>& kept) {
  std::vector<K> out(kept.size());
  for (size_t j = 0; j < kept.size(); ++j) out[j] = keys[kept[j]];
  return out;
}

// fn(tag, tab, rule, slots) for update rule `rule_name` (tag: rules::
// WithRule's type tag) on `at`'s table typed by its keys (tab), once the
// names of the rule's hyper-parameters and slots (comma-joined) check; the
// error otherwise (an unknown rule, names that do not match).
template <typename Fn>
ffi::Error WithCheckedRule(AnyTable& at, std::string_view rule_name, std::string_view hparam_names,
                           std::string_view slot_names, Fn&& fn) {
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
    result = at.Visit([&](auto& tab) -> ffi::Error { return fn(tag, tab, rule, slots); });
  });
  return result;
}

// The binding of a handler for XLA_FFI_DEFINE_HANDLER_SYMBOL:
// TokenBinding<Args<In...>, Rets<Out...>>() takes the token and In... and
// returns the token and Out... (as ffi::Ffi::Bind().Arg<ffi::Token>()
// .Arg<In>()... .Ret<ffi::Token>().Ret<Out>()...); its attributes follow.
template <typename... T>
struct Args {};
template <typename... T>
struct Rets {};

namespace binding {

template <typename T>
struct ArgOf {};
template <typename T>
struct RetOf {};

template <ffi::ExecutionStage S, typename... Ts, typename T>
auto operator|(ffi::Binding<S, Ts...>&& b, ArgOf<T>) {
  return std::move(b).template Arg<T>();
}
template <ffi::ExecutionStage S, typename... Ts, typename T>
auto operator|(ffi::Binding<S, Ts...>&& b, RetOf<T>) {
  return std::move(b).template Ret<T>();
}

template <typename In, typename Out>
struct Tokened;
template <typename... In, typename... Out>
struct Tokened<Args<In...>, Rets<Out...>> {
  static auto Bind() {
    return ((ffi::Ffi::Bind().Arg<ffi::Token>() | ... | ArgOf<In>{}).template Ret<ffi::Token>() |
            ... | RetOf<Out>{});
  }
};

}  // namespace binding

template <typename In, typename Out = Rets<>>
auto TokenBinding() {
  return binding::Tokened<In, Out>::Bind();
}

// b with the attributes of an update handler (WithCheckedRule): the table,
// the rule, and its hyper-parameters' and slots' names (comma-joined).
template <typename B>
auto WithRuleAttrs(B&& b) {
  return std::move(b)
      .template Attr<int64_t>("table")
      .template Attr<std::string_view>("rule")
      .template Attr<std::string_view>("hparam_names")
      .template Attr<std::string_view>("slots");
}

}  // namespace jaxbind
}  // namespace kre

#endif  // KRE_JAX_HANDLERS_H_
