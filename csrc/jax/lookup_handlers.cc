// Copyright keras_rec_emb authors. Apache-2.0.
//
// The plain lookup's XLA FFI handler: keys of any shape -> their rows
// (handlers.h says what every handler shares).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "jax/handlers.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace kre {
namespace jaxbind {
namespace {

template <typename K>
void LookupPruned(kv::Table<K>& table, const K* keys, int64_t n, bool insert, float* out) {
  const int64_t dim = table.dim();
  const std::vector<int64_t> kept = KeptPositions(keys, n);
  if (static_cast<int64_t>(kept.size()) == n) {
    // No padding: the rows go straight to `out`.
    LookupRows(table, keys, n, insert, out);
    return;
  }
  const std::vector<K> kept_keys = KeysAt(keys, kept);
  std::vector<float> rows(kept.size() * dim);
  LookupRows(table, kept_keys.data(), static_cast<int64_t>(kept.size()), insert, rows.data());
  std::fill(out, out + n * dim, 0.0f);
  for (size_t j = 0; j < kept.size(); ++j) {
    std::copy(rows.begin() + j * dim, rows.begin() + (j + 1) * dim, out + kept[j] * dim);
  }
}

ffi::Error Lookup(ffi::Token, ffi::AnyBuffer keys, ffi::Result<ffi::Token>,
                  ffi::ResultBuffer<ffi::F32> out, int64_t table, bool insert, bool prune) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
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

}  // namespace

// The handlers' C symbols (extern "C": unmangled), which
// keras_rec_emb/_jax/ffi.py registers with jax.ffi.register_ffi_target
// (with table_host.cc's functions, the only symbols the library exports).
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(KreTableLookup, Lookup,
                              (TokenBinding<Args<ffi::AnyBuffer>, Rets<ffi::Buffer<ffi::F32>>>()
                                   .Attr<int64_t>("table")
                                   .Attr<bool>("insert")
                                   .Attr<bool>("prune")));

#pragma GCC visibility pop

}  // namespace jaxbind
}  // namespace kre
