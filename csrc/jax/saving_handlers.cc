// Copyright keras_rec_emb authors. Apache-2.0.
//
// Export, import and the parts of a saved table as XLA FFI handlers: the
// admitted keys with their rows, counts, versions and slots (Export), the
// parts Export lacks (SaveInfo, ExportAux), the import that restores all
// of them (Import), and the merge of rows into the live table (Merge).
// handlers.h says what every handler shares.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "jax/handlers.h"
#include "kv/table.h"
#include "xla/ffi/api/ffi.h"

namespace kre {
namespace jaxbind {
namespace {

// Checks the int vectors `freqs` and `versions` of `capacity` rows and the
// int scalar `count` of an export's outputs (`what` names the vectors).
ffi::Error CheckCountOutputs(const ffi::AnyBuffer& freqs, const ffi::AnyBuffer& versions,
                             const ffi::AnyBuffer& count, int64_t capacity, const char* what) {
  for (const ffi::AnyBuffer& b : {freqs, versions}) {
    if (!IsInt(b) || b.dimensions().size() != 1 || b.dimensions()[0] != capacity) {
      return Invalid(string("the ") + what + " outputs must be int vectors of " +
                     std::to_string(capacity));
    }
  }
  if (!IsInt(count) || count.element_count() != 1) {
    return Invalid("the count output must be an int scalar");
  }
  return ffi::Error::Success();
}

// Writes values[0..n) into integer output `b` (SetInt).
void SetInts(ffi::AnyBuffer b, const std::vector<int64_t>& values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) SetInt(b, i, values[i]);
}

// The slots' widths summed.
template <typename K>
int64_t TotalSlotWidth(const kv::Table<K>& table) {
  int64_t width = 0;
  for (const auto& s : table.Slots()) width += s.width;
  return width;
}

// tab.Export into the buffers that buffers(n, nf, freqs, versions) names
// when the keys `count` counts (the admitted ones, or with `filtered` those
// counted but not admitted) fit in `capacity` rows: count[0] is their
// number, and their frequencies and versions (read into `freqs` and
// `versions`, scratch memory) go to outputs `freqs_out` and
// `versions_out`. Nothing is written when they do not fit.
template <typename K, typename Buffers>
void ExportCounted(kv::Table<K>& tab, bool filtered, int64_t capacity, ffi::AnyBuffer count,
                   ffi::AnyBuffer freqs_out, ffi::AnyBuffer versions_out, Buffers&& buffers) {
  std::vector<int64_t> f, v;
  int64_t exported = -1;
  tab.Export([&](int64_t n, int64_t nf) -> std::optional<typename kv::Table<K>::ExportBuffers> {
    const int64_t m = filtered ? nf : n;
    SetInt(count, 0, m);
    if (m > capacity) return std::nullopt;
    exported = m;
    f.resize(m);
    v.resize(m);
    return buffers(n, nf, f.data(), v.data());
  });
  SetInts(freqs_out, f, exported);
  SetInts(versions_out, v, exported);
}

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
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    const ffi::DataType key_type = KeyType(at);
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
    if (ffi::Error e = CheckCountOutputs(*freqs, *versions, *count, capacity, "freqs and versions");
        e.failure()) {
      return e;
    }
    return at.Visit([&](auto& tab) -> ffi::Error {
      using K = KeyOfT<decltype(tab)>;
      const int64_t width = TotalSlotWidth(tab);
      if (slots->dimensions()[0] != capacity || slots->dimensions()[1] != width) {
        return Invalid("the slots output must be [capacity, total slot width] = [" +
                       std::to_string(capacity) + ", " + std::to_string(width) + "], got " +
                       Shape(slots->dimensions()));
      }
      std::vector<K> skip_keys;
      std::vector<int64_t> skip_freqs, skip_versions;
      auto buffers = [&](int64_t, int64_t nf, int64_t* f, int64_t* v) {
        skip_keys.resize(nf);
        skip_freqs.resize(nf);
        skip_versions.resize(nf);
        return typename kv::Table<K>::ExportBuffers{keys->reinterpret_data<K>(),
                                                    values->typed_data(),
                                                    f,
                                                    v,
                                                    slots->typed_data(),
                                                    skip_keys.data(),
                                                    skip_freqs.data(),
                                                    skip_versions.data()};
      };
      ExportCounted(tab, /*filtered=*/false, capacity, *count, *freqs, *versions, buffers);
      return ffi::Error::Success();
    });
  });
}

// The TensorFlow backend's EmbeddingVariable saves every part of
// keras_rec_emb/variables.py's PARTS; these handlers give the JAX binding
// the parts Export lacks (initializer matrix, Bloom counters, keys counted
// but not admitted) and the import that restores all of them.

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

// out: [default_value_dim, Bloom counter bytes, keys counted but not admitted].
ffi::Error SaveInfo(ffi::Token, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                    int64_t table) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    if (!IsInt(*out) || out->element_count() != 3) {
      return Invalid("the save-info output must be 3 int32 or int64 values");
    }
    at.Visit([&](auto& tab) {
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
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
    const ffi::DataType key_type = KeyType(at);
    if (keys_f->dimensions().size() != 1 || keys_f->element_type() != key_type) {
      return Invalid("the keys_filtered output must be a vector of " + DtypeName(key_type));
    }
    const int64_t capacity = keys_f->dimensions()[0];
    if (ffi::Error e = CheckCountOutputs(*freqs_f, *versions_f, *count, capacity,
                                         "freqs_filtered and versions_filtered");
        e.failure()) {
      return e;
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
      const int64_t width = TotalSlotWidth(tab);
      std::vector<K> k;
      std::vector<float> values, slots;
      std::vector<int64_t> f, v;
      auto buffers = [&](int64_t n, int64_t, int64_t* ff, int64_t* vf) {
        k.resize(n);
        values.resize(n * dim);
        slots.resize(n * width);
        f.resize(n);
        v.resize(n);
        return typename kv::Table<K>::ExportBuffers{k.data(),     values.data(),
                                                    f.data(),     v.data(),
                                                    slots.data(), keys_f->reinterpret_data<K>(),
                                                    ff,           vf};
      };
      ExportCounted(tab, /*filtered=*/true, capacity, *count, *freqs_f, *versions_f, buffers);
      return ffi::Error::Success();
    });
  });
}

// Writes Import's checked parts into `tab`: the live table with
// `clear=false` (a delta of an incremental checkpoint: rows overwritten or
// added, keys counted but not admitted added, the initializer matrix and
// Bloom counters replaced when given, as TensorFlow's KRE>TableImport with
// clear=false), or the staging table of a restore.
template <typename K>
ffi::Error WriteParts(kv::Table<K>& tab, const std::vector<string>& names,
                      const std::vector<int64_t>& widths, const ffi::Buffer<ffi::F32>& defaults,
                      const K* keys, const ffi::Buffer<ffi::F32>& values,
                      const std::vector<int64_t>& f, const std::vector<int64_t>& v, int64_t n,
                      const ffi::Buffer<ffi::F32>& slot_values, const K* keys_filtered,
                      const std::vector<int64_t>& ff, const std::vector<int64_t>& vf, int64_t nf,
                      const ffi::Buffer<ffi::U8>& bloom) {
  std::vector<int> ids;
  for (size_t j = 0; j < names.size(); ++j) {
    const int id = tab.SlotIndex(names[j]);
    ids.push_back(id >= 0 ? id : tab.AddSlot(names[j], widths[j], 0.0f));
  }
  if (defaults.dimensions()[0] > 0) {
    const float* d = defaults.typed_data();
    tab.SetDefaultValues(std::vector<float>(d, d + defaults.element_count()));
  }
  tab.Import(keys, values.typed_data(), f.data(), v.data(), n, slot_values.typed_data(), ids,
             widths);
  tab.ImportFiltered(keys_filtered, ff.data(), vf.data(), nf);
  if (bloom.element_count() != 0 && !tab.SetBloomState(bloom.typed_data(), bloom.element_count())) {
    return Invalid("`bloom` is not a counting Bloom filter state of this table's settings");
  }
  return ffi::Error::Success();
}

// Replaces the contents of the table with the parts of a saved table (see
// keras_rec_emb/variables.py's PARTS): admitted keys with rows, frequencies,
// versions and slot columns (`slot_values`, blocks of `slot_widths` columns
// for the comma-joined `slot_names`; a slot the table lacks is added), the
// initializer matrix (kept when `default_values` has no rows), the keys
// counted but not admitted, and the Bloom counters (kept when empty).
// Every part is checked first; the new contents are built beside the table
// and swapped in, so a failed import leaves the table as it was. With
// `clear` false the parts are merged into the live table instead.
ffi::Error Import(ffi::Token, ffi::AnyBuffer keys, ffi::Buffer<ffi::F32> values,
                  ffi::AnyBuffer freqs, ffi::AnyBuffer versions, ffi::Buffer<ffi::F32> slot_values,
                  ffi::AnyBuffer slot_widths, ffi::Buffer<ffi::F32> default_values,
                  ffi::AnyBuffer keys_filtered, ffi::AnyBuffer freqs_filtered,
                  ffi::AnyBuffer versions_filtered, ffi::Buffer<ffi::U8> bloom,
                  ffi::Result<ffi::Token>, int64_t table, std::string_view slot_names, bool clear) {
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
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
      auto write_into = [&](kv::Table<K>& dst) {
        return WriteParts(dst, names, widths, default_values, k->data(), values, f, v, n,
                          slot_values, kf->data(), ff, vf, nf, bloom);
      };
      if (!clear) return write_into(tab);
      kv::TableOptions options = tab.options();
      options.default_values = tab.DefaultValues();
      options.storage_lock = false;  // a staging table beside the live one
      kv::Table<K> staging(std::move(options));
      for (const auto& spec : specs) staging.AddSlot(spec.name, spec.width, spec.init);
      if (ffi::Error e = write_into(staging); e.failure()) return e;
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
  return OnTable(table, [&](AnyTable& at) -> ffi::Error {
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
      const std::vector<K> ks = KeysAt(k, kept);
      const std::vector<int64_t> v(m, std::max<int64_t>(tab.LatestStep(), 0));
      tab.Import(ks.data(), rows.data(), f.data(), v.data(), m, nullptr, {}, {});
      return ffi::Error::Success();
    });
  });
}

}  // namespace

// The handlers' C symbols (extern "C": unmangled), which
// keras_rec_emb/_jax/ffi.py registers with jax.ffi.register_ffi_target.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableExport, Export,
    (TokenBinding<Args<>, Rets<ffi::AnyBuffer, ffi::BufferR2<ffi::F32>, ffi::AnyBuffer,
                               ffi::AnyBuffer, ffi::BufferR2<ffi::F32>, ffi::AnyBuffer>>()
         .Attr<int64_t>("table")));

// Save and restore.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableSaveInfo, SaveInfo,
    (TokenBinding<Args<>, Rets<ffi::AnyBuffer>>().Attr<int64_t>("table")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableExportAux, ExportAux,
    (TokenBinding<Args<>, Rets<ffi::BufferR2<ffi::F32>, ffi::BufferR1<ffi::U8>, ffi::AnyBuffer,
                               ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer>>()
         .Attr<int64_t>("table")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableImport, Import,
    (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::AnyBuffer, ffi::AnyBuffer,
                       ffi::Buffer<ffi::F32>, ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::AnyBuffer,
                       ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::U8>>>()
         .Attr<int64_t>("table")
         .Attr<std::string_view>("slot_names")
         .Attr<bool>("clear")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KreTableMerge, Merge,
    (TokenBinding<Args<ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::AnyBuffer, ffi::AnyBuffer>>()
         .Attr<int64_t>("table")));

#pragma GCC visibility pop

}  // namespace jaxbind
}  // namespace kre
