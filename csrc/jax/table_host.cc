// Copyright keras_rec_emb authors. Apache-2.0.
//
// Table management for the JAX binding as plain C functions, which
// keras_rec_emb/_jax/ffi.py calls through ctypes: create, destroy, add a
// slot, size, evict, statistics, the file tier's snapshots. They are host calls
// that must take effect when Python makes
// them, whatever JAX is tracing (a Keras layer builds its table inside the
// trace of the model's first call or symbolic build); an XLA custom call
// made then would be staged into that computation and run only if the
// computation ever runs. Lookups and updates stay XLA custom calls
// (csrc/jax/*_handlers.cc), ordered by JAX's effect token. Both reach the tables
// through the one registry (table_registry.h).
//
// Each function returns 0 on success, kKreInvalid for bad input and
// kKreFailed when the engine fails (allocation); the message, naming the
// argument, is written to `error` (NUL-terminated, truncated to
// `error_size`). No exception leaves these functions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "jax/table_registry.h"
#include "kv/table.h"

namespace kre {
namespace jaxbind {
namespace {

constexpr int kKreOk = 0;
constexpr int kKreInvalid = 1;
constexpr int kKreFailed = 2;

int Fail(int code, const std::string& message, char* error, size_t error_size) {
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(message.size(), error_size - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return code;
}

// Runs `body` (which returns a status); an exception that escapes it (the
// engine's) becomes kKreFailed with its message instead of ending the
// process.
template <typename Body>
int Guarded(char* error, size_t error_size, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return Fail(kKreFailed, std::string("embedding table operation failed: ") + e.what(), error,
                error_size);
  }
}

std::string NoTable(int64_t handle) {
  return "no embedding table has handle " + std::to_string(handle) +
         " (it was destroyed, or made in another process)";
}

// Guarded body(table) on the table of `handle` (kKreInvalid naming it when
// there is none).
template <typename Body>
int OnHostTable(int64_t handle, char* error, size_t error_size, Body&& body) {
  return Guarded(error, error_size, [&]() -> int {
    std::shared_ptr<AnyTable> t = Tables().Get(handle);
    if (t == nullptr) return Fail(kKreInvalid, NoTable(handle), error, error_size);
    t->Settle();  // (table_registry.h) its failure is this call's
    return body(*t);
  });
}

// body(tab) on the typed table of `handle`, which must have a file tier
// (kKreInvalid otherwise); an exception of body other than bad_alloc (the
// file tier's I/O) becomes `code` with message `what` + its own.
template <typename Body>
int OnFileTier(int64_t handle, char* error, size_t error_size, int code, const char* what,
               Body&& body) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    return t.Visit([&](auto& tab) -> int {
      if (!tab.file_tier()) {
        return Fail(kKreInvalid,
                    "snapshots need a file-tier table (StorageOption(\"FILE\", "
                    "storage_path=...))",
                    error, error_size);
      }
      try {
        body(tab);
      } catch (const std::bad_alloc&) {
        throw;
      } catch (const std::exception& e) {
        return Fail(code, what + std::string(e.what()), error, error_size);
      }
      return kKreOk;
    });
  });
}

}  // namespace
}  // namespace jaxbind
}  // namespace kre

using kre::jaxbind::AnyTable;
using kre::jaxbind::Fail;
using kre::jaxbind::Guarded;
using kre::jaxbind::kKreFailed;
using kre::jaxbind::kKreInvalid;
using kre::jaxbind::kKreOk;
using kre::jaxbind::NoTable;
using kre::jaxbind::OnFileTier;
using kre::jaxbind::OnHostTable;
using kre::jaxbind::Tables;

#pragma GCC visibility push(default)

// A new table whose initializer is `defaults` [rows, dim] (row-major);
// writes its handle (>= 1) to `*handle`. `bloom_counters` > 0 gives it a
// counting Bloom filter of that many counters of `bloom_counter_bytes`
// bytes with `bloom_hashes` hashes per key (a CBFFilter's sizing), which
// then admits keys at `filter_freq`. A non-empty `storage_path` puts the
// rows in the file tier (kv/file_store.h) under that folder, which the
// table locks, with a DRAM cache of about `cache_bytes` (>= 1).
extern "C" int KreHostCreate(const float* defaults, int64_t rows, int64_t dim, int32_t key_bits,
                             int32_t num_shards, int32_t track_meta, int64_t filter_freq,
                             float no_permission_value, int64_t freq_cap, int64_t bloom_counters,
                             int32_t bloom_hashes, int32_t bloom_counter_bytes,
                             const char* storage_path, int64_t cache_bytes, int64_t* handle,
                             char* error, size_t error_size) {
  return Guarded(error, error_size, [&]() -> int {
    auto invalid = [&](const std::string& m) { return Fail(kKreInvalid, m, error, error_size); };
    if (rows < 1 || dim < 1) {
      return invalid("`default_values` must be [default_value_dim >= 1, dim >= 1], got [" +
                     std::to_string(rows) + ", " + std::to_string(dim) + "]");
    }
    if (key_bits != 32 && key_bits != 64) {
      return invalid("`key_bits` must be 32 or 64, got " + std::to_string(key_bits));
    }
    if (num_shards < 1 || num_shards > 65536) {
      return invalid("`num_shards` must be in [1, 65536], got " + std::to_string(num_shards));
    }
    if (freq_cap < 0) return invalid("`freq_cap` must be >= 0, got " + std::to_string(freq_cap));
    if (bloom_counters < 0) {
      return invalid("`bloom_counters` must be >= 0, got " + std::to_string(bloom_counters));
    }
    // NaN is AdaptiveEmbedding's sentinel for "still counting" (as under
    // TensorFlow, whose options refuse it from users).
    if (std::isinf(no_permission_value)) {
      return invalid("`no_permission_value` must be finite or NaN");
    }
    if (cache_bytes < 1) {
      return invalid("`cache_bytes` must be >= 1, got " + std::to_string(cache_bytes));
    }
    const int64_t count = rows * dim;
    if (!std::all_of(defaults, defaults + count, [](float v) { return !std::isnan(v); })) {
      return invalid("`default_values` must not hold NaN");
    }
    kre::kv::TableOptions options;
    options.dim = dim;
    options.default_values.assign(defaults, defaults + count);
    options.num_shards = num_shards;
    options.track_meta = track_meta != 0;
    options.filter_freq = filter_freq;
    options.no_permission_value = no_permission_value;
    options.freq_cap = freq_cap;
    options.bloom_counters = static_cast<uint64_t>(bloom_counters);
    options.bloom_hashes = bloom_hashes;
    options.bloom_counter_bytes = bloom_counter_bytes;
    options.storage_path = storage_path == nullptr ? std::string() : std::string(storage_path);
    options.cache_bytes = static_cast<uint64_t>(cache_bytes);
    std::shared_ptr<AnyTable> table;
    try {
      table = std::make_shared<AnyTable>(key_bits, std::move(options));
    } catch (const std::bad_alloc&) {
      if (bloom_counters > 0) {
        return Fail(kKreFailed,
                    "could not allocate the embedding table's counting Bloom filter of "
                    "bloom_counters=" +
                        std::to_string(bloom_counters) + " counters of " +
                        std::to_string(bloom_counter_bytes) +
                        " bytes; lower CBFFilter's max_element_size or raise its "
                        "false_positive_probability",
                    error, error_size);
      }
      throw;
    } catch (const std::exception& e) {
      return invalid(e.what());
    }
    const int64_t h = Tables().Add(std::move(table));
    if (h < 0) {
      return Fail(kKreFailed, "no embedding table handle is left in this process", error,
                  error_size);
    }
    *handle = h;
    return kKreOk;
  });
}

extern "C" int KreHostDestroy(int64_t handle, char* error, size_t error_size) {
  if (std::shared_ptr<AnyTable> t = Tables().Get(handle)) {
    // A deferred update finishes before its table goes (its failure goes
    // with the table).
    try {
      t->Settle();
    } catch (const std::exception&) {
    }
  }
  if (!Tables().Remove(handle)) {
    return Fail(kKreInvalid,
                "no embedding table has handle " + std::to_string(handle) + " (destroyed twice?)",
                error, error_size);
  }
  return kKreOk;
}

// Adds optimizer slot `name` of `width` floats per row, `init` for new rows
// (an existing slot keeps its rows and must have the same width).
extern "C" int KreHostAddSlot(int64_t handle, const char* name, int64_t width, float init,
                              char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    auto invalid = [&](const std::string& m) { return Fail(kKreInvalid, m, error, error_size); };
    const std::string slot = name == nullptr ? std::string() : std::string(name);
    if (slot.empty()) return invalid("`slot_name` must not be empty");
    if (slot.find(',') != std::string::npos) {
      return invalid("`slot_name` must not contain ',', got '" + slot + "'");
    }
    if (width < 1 || width > (int64_t{1} << 20)) {
      return invalid("`width` must be in [1, 2**20], got " + std::to_string(width));
    }
    if (!std::isfinite(init)) return invalid("`init` must be finite");
    return t.Visit([&](auto& tab) -> int {
      try {
        tab.AddSlot(slot, width, init);
      } catch (const std::bad_alloc&) {
        throw;
      } catch (const std::exception& e) {
        return invalid(e.what());
      }
      return kKreOk;
    });
  });
}

// out: [admitted keys, keys counted but not admitted, total slot width,
// number of slots].
extern "C" int KreHostSize(int64_t handle, int64_t* out, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    t.Visit([&](auto& tab) {
      int64_t width = 0;
      const std::vector<kre::kv::SlotSpec> specs = tab.Slots();
      for (const auto& s : specs) width += s.width;
      out[0] = tab.Size();
      out[1] = tab.FilteredSize();
      out[2] = width;
      out[3] = static_cast<int64_t>(specs.size());
    });
    return kKreOk;
  });
}

// Erases keys as kv::Table::Evict does: admitted keys whose version is
// older than now - steps_to_live (steps_to_live >= 0), admitted keys with
// 0.5 * sum(row**2) < l2_threshold (l2_threshold >= 0), and keys counted
// but not admitted whose last lookup is older than now - steps_to_live.
// `now` < 0 is the latest step that updated the table. Writes the number
// of keys erased to `*erased`.
extern "C" int KreHostEvict(int64_t handle, int64_t now, int64_t steps_to_live, float l2_threshold,
                            int64_t* erased, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    if (std::isnan(l2_threshold)) {
      return Fail(kKreInvalid, "`l2_threshold` must not be NaN", error, error_size);
    }
    *erased = t.Visit([&](auto& tab) { return tab.Evict(now, steps_to_live, l2_threshold); });
    return kKreOk;
  });
}

// The table's statistics, into out[0..17]: admitted keys, keys counted but
// not admitted, memory bytes, latest step (keras_rec_emb/_ops.py's
// TABLE_STATS); rows, cached rows, cache memory bytes, disk bytes, cache
// hits, cache misses, file reads, file writes (STORAGE_STATS); lookups,
// hits, admitted total, erased total, change epoch, erased-log entries
// (the rest of COUNTER_PARTS).
extern "C" int KreHostStats(int64_t handle, int64_t* out, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    t.Visit([&](auto& tab) {
      const kre::kv::RowStoreStats s = tab.StoreStats();
      const kre::kv::TableCounters c = tab.Counters();
      const int64_t values[] = {tab.Size(),
                                tab.FilteredSize(),
                                static_cast<int64_t>(tab.MemoryBytes()),
                                tab.LatestStep(),
                                int64_t(s.rows),
                                int64_t(s.cached_rows),
                                int64_t(s.memory_bytes),
                                int64_t(s.disk_bytes),
                                int64_t(s.hits),
                                int64_t(s.misses),
                                int64_t(s.file_reads),
                                int64_t(s.file_writes),
                                int64_t(c.lookups),
                                int64_t(c.hits),
                                int64_t(c.admitted),
                                int64_t(c.erased),
                                tab.ChangeEpoch(),
                                tab.ErasedLogSize()};
      std::copy(std::begin(values), std::end(values), out);
    });
    return kKreOk;
  });
}

// File tier: writes a crash-safe snapshot under the table's folder and
// writes its number to `*sequence` (kKreFailed naming the file on an I/O
// error).
extern "C" int KreHostSnapshot(int64_t handle, int64_t* sequence, char* error, size_t error_size) {
  return OnFileTier(handle, error, error_size, kKreFailed,
                    "snapshot failed: ", [&](auto& tab) { *sequence = tab.Snapshot(); });
}

// File tier: replaces the contents with the latest snapshot under `path`
// (the table's folder when empty); writes the number of keys to `*count`.
// A missing, corrupt or truncated snapshot is kKreInvalid naming the file,
// and leaves the table as it was.
extern "C" int KreHostRestoreSnapshot(int64_t handle, const char* path, int64_t* count, char* error,
                                      size_t error_size) {
  return OnFileTier(
      handle, error, error_size, kKreInvalid, "snapshot restore failed: ", [&](auto& tab) {
        *count = tab.RestoreSnapshot(path == nullptr ? std::string() : std::string(path));
      });
}

// File tier: releases the lock on the table's folder (its layer is gone;
// another table may take the folder), as TensorFlow's TableReleaseStorage.
extern "C" int KreHostReleaseStorage(int64_t handle, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    t.Visit([&](auto& tab) {
      if (tab.file_tier()) tab.ReleaseStorageLock();
    });
    return kKreOk;
  });
}

// Change tracking (incremental checkpoints), as TensorFlow's
// KRE>TableMarkChanges, KRE>TableExportChangedSince, KRE>TableTrimErased
// and KRE>TableErase (csrc/ops/delta_ops.cc).
//
// Closes the table's change epoch; writes it (the mark) to `*mark`.
extern "C" int KreHostMarkChanges(int64_t handle, int64_t* mark, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    *mark = t.Visit([](auto& tab) { return tab.MarkChanges(); });
    return kKreOk;
  });
}

// Exports the keys changed after mark `since` into buffers of `capacity`
// [admitted, counted-but-not-admitted, erased] rows and `width` slot
// columns: keys, values [capacity[0], dim], freqs, versions, slots
// [capacity[0], width] (slot columns in slot order), keys_filtered,
// freqs_filtered, versions_filtered, erased (keys of the table's key type).
// Writes to `counts` [admitted, counted, erased, total slot width,
// complete (1, or 0 when the contents were replaced wholesale after
// `since`)]. When a count exceeds its capacity, or the slot width is not
// `width`, nothing is written but `counts` (ask again with those sizes).
extern "C" int KreHostExportChanges(int64_t handle, int64_t since, const int64_t* capacity,
                                    int64_t width, void* keys, float* values, int64_t* freqs,
                                    int64_t* versions, float* slots, void* keys_filtered,
                                    int64_t* freqs_filtered, int64_t* versions_filtered,
                                    void* erased, int64_t* counts, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    t.Visit([&](auto& tab) {
      using K = kre::jaxbind::KeyOfT<decltype(tab)>;
      using Buffers = typename kre::kv::Table<K>::ExportBuffers;
      std::vector<K> gone;
      int64_t total = 0;
      for (const auto& s : tab.Slots()) total += s.width;
      const bool complete = tab.ExportChangedSince(
          since,
          [&](int64_t n, int64_t nf) -> std::optional<Buffers> {
            const int64_t ne = static_cast<int64_t>(gone.size());
            const int64_t found[] = {n, nf, ne, total};
            std::copy(std::begin(found), std::end(found), counts);
            if (n > capacity[0] || nf > capacity[1] || ne > capacity[2] || total != width) {
              return std::nullopt;
            }
            std::copy(gone.begin(), gone.end(), static_cast<K*>(erased));
            return Buffers{static_cast<K*>(keys),
                           values,
                           freqs,
                           versions,
                           slots,
                           static_cast<K*>(keys_filtered),
                           freqs_filtered,
                           versions_filtered};
          },
          &gone);
      counts[4] = complete ? 1 : 0;
    });
    return kKreOk;
  });
}

// Forgets logged erasures at or before mark `upto`; writes the number
// still logged to `*remaining`.
extern "C" int KreHostTrimErased(int64_t handle, int64_t upto, int64_t* remaining, char* error,
                                 size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    *remaining = t.Visit([&](auto& tab) {
      tab.TrimErasedLog(upto);
      return tab.ErasedLogSize();
    });
    return kKreOk;
  });
}

// Erases keys[0 .. n) (of `key_bits` bits, the table's; absent ones are
// skipped); writes how many were present to `*erased`.
extern "C" int KreHostErase(int64_t handle, const void* keys, int64_t n, int32_t key_bits,
                            int64_t* erased, char* error, size_t error_size) {
  return OnHostTable(handle, error, error_size, [&](AnyTable& t) -> int {
    if (key_bits != t.key_bits()) {
      return Fail(kKreInvalid,
                  "`keys` must be int" + std::to_string(t.key_bits()) +
                      " (the table's key type), got int" + std::to_string(key_bits),
                  error, error_size);
    }
    *erased = t.Visit([&](auto& tab) {
      using K = kre::jaxbind::KeyOfT<decltype(tab)>;
      const K* k = static_cast<const K*>(keys);
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += tab.Erase(k[i]) ? 1 : 0;
      return count;
    });
    return kKreOk;
  });
}

// The number of live tables (for tests: a destroyed table is gone).
extern "C" int64_t KreLiveTables() { return Tables().Count(); }

#pragma GCC visibility pop
