// Copyright keras_rec_emb authors. Apache-2.0.
// KeepRows: the split of stacked ids [batch, F, L] into each feature's kept
// ids (ids >= 0, or every id without pruning) and row splits, in one pass
// over the input. Used by KRE>UnstackKeptIds (csrc/kernels/stack_kernels.cc),
// KRE>StackedPooledLookup (csrc/kernels/stacked_lookup_kernels.cc) and the
// JAX group lookup (csrc/jax/pooled_handlers.cc).
#ifndef KRE_CORE_KEEP_ROWS_H_
#define KRE_CORE_KEEP_ROWS_H_

#include <cstdint>
#include <type_traits>
#include <vector>

namespace kre {

// Copies the ids >= 0 of features [j0, j1) of ids [batch, F, L], row by
// row, to out[j] (room for batch * L ids), their row splits to splits[j]
// ([batch + 1]), and their number to kept[j]. An id is written, then
// overwritten when it is padding: no branch on the ids (mixed lengths
// mispredict about once a row), and no write past a feature's batch * L
// (the count never passes the ids read). The input is read once, row by
// row; each row's counts go to a small matrix and the splits are summed
// from it feature by feature afterwards: writing the splits in the row loop
// too made twice as many output streams, which is slower when the outputs
// are not in cache (as they are not after a lookup). For the same reason
// each feature's output is prefetched for writing kKeepAhead ids ahead: F
// streams of stores that miss otherwise fill the store buffer, each waiting
// on its line (16 to 128 ids ahead did alike; measurements: docs/history.md,
// sessions 13 and 15). A prefetch never faults, also past an output's end.
constexpr int64_t kKeepAhead = 32;

// Features a thread takes at once when KeepRows is split over a pool: one
// contiguous block a thread. Each call reads its features' slice of every
// input row, so blocks of one feature (16 a thread) read each row's lines
// once per feature: on two threads the split of the peer workload's
// [4096, 26, 5] ids took 2.4-3.0 CPU-ms and 1.5-1.8 ms against 0.9-1.0 ms
// on one thread; in one block a thread, 1.3-1.4 CPU-ms and 0.9-1.4 ms
// (docs/performance.md).
constexpr int64_t kKeepRowsRangesPerThread = 1;

// Row counts a thread keeps for its next call; a larger matrix (a huge
// request) is freed on return, not held by the thread for good. Its
// allocation may throw std::bad_alloc: callers run KeepRows where that
// becomes a status (ShardChecked, or the JAX handlers' catch).
constexpr int64_t kKeepCountsKept = int64_t{1} << 22;

// With kPrune false every id is kept (a table whose negative ids are ids).
template <typename T, int kL, bool kPrune = true>
inline void KeepRows(const T* __restrict ids, int64_t f, int64_t l, int64_t batch, int64_t j0,
                     int64_t j1, int64_t* const* out, int64_t* const* splits, int64_t* kept) {
  using Count = std::conditional_t<(kL > 0 && kL < 256), uint8_t, int64_t>;
  const int64_t n = kL > 0 ? kL : l;
  const int64_t w = j1 - j0;
  thread_local std::vector<Count> counts;  // [batch, w]
  counts.resize(batch * w);
  for (int64_t j = j0; j < j1; ++j) kept[j] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const T* row = ids + b * f * n;
    Count* c = counts.data() + b * w;  // c[j - j0]: feature j's count in row b
    for (int64_t j = j0; j < j1; ++j) {
      int64_t* __restrict dst = out[j];
      const T* src = row + j * n;
      const int64_t m0 = kept[j];
      __builtin_prefetch(dst + m0 + kKeepAhead, 1);
      int64_t m = m0;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t id = static_cast<int64_t>(src[k]);
        dst[m] = id;
        m += !kPrune || id >= 0;
      }
      kept[j] = m;
      c[j - j0] = static_cast<Count>(m - m0);
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    int64_t* __restrict sp = splits[j];
    const Count* c = counts.data() + (j - j0);
    int64_t m = 0;
    sp[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      m += c[b * w];
      sp[b + 1] = m;
    }
  }
  if (static_cast<int64_t>(counts.capacity()) > kKeepCountsKept) std::vector<Count>().swap(counts);
}

template <typename T>
inline void KeepRowsAnyLength(const T* ids, int64_t f, int64_t l, int64_t batch, int64_t j0,
                              int64_t j1, int64_t* const* out, int64_t* const* splits,
                              int64_t* kept, bool prune = true) {
  switch (l) {
#define KRE_KEEP_CASE(L)                                                             \
  case L:                                                                            \
    return prune ? KeepRows<T, L, true>(ids, f, l, batch, j0, j1, out, splits, kept) \
                 : KeepRows<T, L, false>(ids, f, l, batch, j0, j1, out, splits, kept);
    KRE_KEEP_CASE(1)
    KRE_KEEP_CASE(2)
    KRE_KEEP_CASE(3)
    KRE_KEEP_CASE(4)
    KRE_KEEP_CASE(5)
    KRE_KEEP_CASE(6)
    KRE_KEEP_CASE(7)
    KRE_KEEP_CASE(8)
#undef KRE_KEEP_CASE
    default:
      return prune ? KeepRows<T, 0, true>(ids, f, l, batch, j0, j1, out, splits, kept)
                   : KeepRows<T, 0, false>(ids, f, l, batch, j0, j1, out, splits, kept);
  }
}

}  // namespace kre

#endif  // KRE_CORE_KEEP_ROWS_H_
