// Copyright keras_rec_emb authors. Apache-2.0.
//
// A chunked arena of fixed-width rows. Chunks never move once allocated, so a
// pointer to a row stays valid while the arena grows. Chunk sizes double from
// 16 rows up to 16384 rows and stay there: a small table costs little, and a
// large one over-allocates at most one chunk. Locating a row is a few integer
// ops. Chunks come from PagePool::Global() (huge pages; see page_pool.h).
#ifndef KRE_KV_ARENA_H_
#define KRE_KV_ARENA_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kv/page_pool.h"

namespace kre {
namespace kv {

template <typename T>
class ChunkedArena {
 public:
  static constexpr int kFirstChunkLog2 = 4;  // 16 rows in the first chunk
  static constexpr int kMaxChunkLog2 = 14;   // 16384 rows in later chunks
  static constexpr int kGrowingChunks = kMaxChunkLog2 - kFirstChunkLog2;
  // Rows held by the growing chunks: 16 + 32 + ... + 8192.
  static constexpr uint64_t kGrowingRows = ((uint64_t{1} << kGrowingChunks) - 1) << kFirstChunkLog2;

  explicit ChunkedArena(int64_t width = 1) : width_(width) {}
  ChunkedArena(ChunkedArena&& o) noexcept
      : width_(o.width_), capacity_(o.capacity_), bases_(std::move(o.bases_)) {
    o.capacity_ = 0;
    o.bases_.clear();
  }
  ChunkedArena& operator=(ChunkedArena&& o) noexcept {
    if (this != &o) {
      Clear();
      width_ = o.width_;
      capacity_ = o.capacity_;
      bases_ = std::move(o.bases_);
      o.capacity_ = 0;
      o.bases_.clear();
    }
    return *this;
  }
  ChunkedArena(const ChunkedArena&) = delete;
  ChunkedArena& operator=(const ChunkedArena&) = delete;
  ~ChunkedArena() { Clear(); }

  int64_t width() const { return width_; }

  // Rows [0, capacity()) are addressable.
  uint64_t capacity() const { return capacity_; }

  __attribute__((always_inline)) T* Row(uint64_t id) const {
    return RowIn(bases_.data(), id, width_);
  }

  // The row `id` of an arena whose chunk base pointers are bases[] (see
  // bases()) and rows `width` wide: what Row does, for a caller that keeps
  // the bases at hand (no load of the arena itself on the way).
  __attribute__((always_inline)) static T* RowIn(T* const* bases, uint64_t id, int64_t width) {
    if (id >= kGrowingRows) {
      const uint64_t rel = id - kGrowingRows;
      return bases[kGrowingChunks + (rel >> kMaxChunkLog2)] +
             (rel & ((uint64_t{1} << kMaxChunkLog2) - 1)) * width;
    }
    // Growing chunk c holds ids [B * (2^c - 1), B * (2^(c+1) - 1)), B = 16.
    const uint64_t q = (id >> kFirstChunkLog2) + 1;
    const int c = 63 - __builtin_clzll(q);
    const uint64_t start = ((uint64_t{1} << c) - 1) << kFirstChunkLog2;
    return bases[c] + (id - start) * width;
  }
  // The chunks' base pointers, for RowIn: valid until the arena grows or
  // is cleared.
  T* const* bases() const { return bases_.data(); }

  // Makes ids < n addressable. New memory is filled with `fill`.
  void EnsureCapacity(uint64_t n, T fill) {
    while (capacity_ < n) {
      const int c = static_cast<int>(bases_.size());
      const uint64_t rows = ChunkRows(c);
      bases_.reserve(bases_.size() + 1);
      T* chunk = static_cast<T*>(PagePool::Global().Allocate(ChunkBytes(c)));
      std::fill(chunk, chunk + rows * static_cast<uint64_t>(width_), fill);
      bases_.push_back(chunk);
      capacity_ += rows;
    }
  }

  void Clear() {
    for (size_t c = 0; c < bases_.size(); ++c) {
      PagePool::Global().Free(bases_[c], ChunkBytes(static_cast<int>(c)));
    }
    bases_.clear();
    capacity_ = 0;
  }

  uint64_t BytesAllocated() const { return capacity_ * static_cast<uint64_t>(width_) * sizeof(T); }

 private:
  static uint64_t ChunkRows(int c) {
    return uint64_t{1} << std::min(c + kFirstChunkLog2, kMaxChunkLog2);
  }
  // Chunks start on a cache line (PagePool's blocks are 64-byte aligned), so
  // a row of 64 bytes (dim 16 floats) is one line, not two.
  size_t ChunkBytes(int c) const {
    return ChunkRows(c) * static_cast<uint64_t>(width_) * sizeof(T);
  }

  int64_t width_;
  uint64_t capacity_ = 0;
  std::vector<T*> bases_;  // the chunks, owned (freed by Clear)
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_ARENA_H_
