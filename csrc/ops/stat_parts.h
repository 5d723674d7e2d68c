// Copyright keras_rec_emb authors. Apache-2.0.
// The named parts of the int64 vectors the table's statistics ops return
// (KRE>TableStats, KRE>TableStorageStats, KRE>TableCounters), declared once
// for their op registrations and their kernels.
//
// keras_rec_emb/_ops.py declares the same names (TABLE_STATS, STORAGE_STATS,
// COUNTER_PARTS) and passes them to the op as its `parts` attr; the kernel
// checks them at construction, so a part renamed, reordered, added or
// dropped on one side only fails with InvalidArgument naming both lists
// instead of being read as another number. The attr's default is this list,
// so graphs saved before the attr existed load unchanged.
#ifndef KRE_OPS_STAT_PARTS_H_
#define KRE_OPS_STAT_PARTS_H_

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace kre {

// KRE>TableStats: admitted keys, keys counted but not admitted, all DRAM
// the table holds (bytes), the last optimizer step that updated a row.
inline constexpr std::array<const char*, 4> kTableStatsParts = {"size", "filtered", "memory_bytes",
                                                                "latest_step"};

// KRE>TableStorageStats, the row store's counters: rows, rows in DRAM, row
// bytes in DRAM, bytes on file, cache hits, cache misses, rows read from
// file, rows written to file (a DRAM table: every row in DRAM, no file
// counters).
inline constexpr std::array<const char*, 8> kStorageStatsParts = {
    "rows",       "cached_rows",  "cache_memory_bytes", "disk_bytes",
    "cache_hits", "cache_misses", "file_reads",         "file_writes"};

// KRE>TableCounters: kTableStatsParts, then key occurrences looked up, of
// them found admitted, keys admitted, keys erased (the last four
// cumulative), the open change epoch and the erased-log size.
inline constexpr std::array<const char*, 10> kCounterParts = {
    "size", "filtered",       "memory_bytes", "latest_step",  "lookups",
    "hits", "admitted_total", "erased_total", "change_epoch", "erased_log"};

template <std::size_t N, std::size_t M>
constexpr bool StartsWith(const std::array<const char*, N>& list,
                          const std::array<const char*, M>& prefix) {
  if (M > N) return false;
  for (std::size_t i = 0; i < M; ++i) {
    if (std::string_view(list[i]) != std::string_view(prefix[i])) return false;
  }
  return true;
}
// KRE>TableCounters fills its first parts as KRE>TableStats does.
static_assert(StartsWith(kCounterParts, kTableStatsParts),
              "kCounterParts must begin with kTableStatsParts");

// The spec of the `parts` attr of an op returning a vector of `parts`:
// "parts: list(string) = ['a', 'b', ...]".
template <std::size_t N>
std::string PartsAttr(const std::array<const char*, N>& parts) {
  std::string spec = "parts: list(string) = [";
  for (std::size_t i = 0; i < N; ++i) {
    spec += i ? ", '" : "'";
    spec += parts[i];
    spec += "'";
  }
  return spec + "]";
}

}  // namespace kre

#endif  // KRE_OPS_STAT_PARTS_H_
