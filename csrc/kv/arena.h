// Copyright keras_rec_emb authors. Apache-2.0.
//
// A chunked arena of fixed-width rows. Chunks never move once allocated, so a
// pointer to a row stays valid while the arena grows. Chunk sizes double from
// 16 rows up to 16384 rows and stay there: a small table costs little, and a
// large one over-allocates at most one chunk. Locating a row is a few integer
// ops.
#ifndef KRE_KV_ARENA_H_
#define KRE_KV_ARENA_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace kre {
namespace kv {

template <typename T>
class ChunkedArena {
 public:
  static constexpr int kFirstChunkLog2 = 4;   // 16 rows in the first chunk
  static constexpr int kMaxChunkLog2 = 14;    // 16384 rows in later chunks
  static constexpr int kGrowingChunks = kMaxChunkLog2 - kFirstChunkLog2;
  // Rows held by the growing chunks: 16 + 32 + ... + 8192.
  static constexpr uint64_t kGrowingRows =
      ((uint64_t{1} << kGrowingChunks) - 1) << kFirstChunkLog2;

  explicit ChunkedArena(int64_t width = 1) : width_(width) {}
  ChunkedArena(ChunkedArena&&) = default;
  ChunkedArena& operator=(ChunkedArena&&) = default;

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
      const int c = static_cast<int>(chunks_.size());
      const uint64_t rows = uint64_t{1} << std::min(c + kFirstChunkLog2, kMaxChunkLog2);
      const uint64_t elems = rows * static_cast<uint64_t>(width_);
      Chunk chunk(static_cast<T*>(::operator new(elems * sizeof(T), std::align_val_t(kAlign))));
      std::fill(chunk.get(), chunk.get() + elems, fill);
      bases_.reserve(chunks_.size() + 1);
      chunks_.push_back(std::move(chunk));
      bases_.push_back(chunks_.back().get());
      capacity_ += rows;
    }
  }

  void Clear() {
    chunks_.clear();
    bases_.clear();
    capacity_ = 0;
  }

  uint64_t BytesAllocated() const {
    return capacity_ * static_cast<uint64_t>(width_) * sizeof(T);
  }

 private:
  // Chunks start on a cache line, so a row of 64 bytes (dim 16 floats) is
  // one line, not two (malloc's 16-byte alignment would split most rows).
  static constexpr size_t kAlign = 64;
  struct AlignedDelete {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(kAlign)); }
  };
  using Chunk = std::unique_ptr<T[], AlignedDelete>;

  int64_t width_;
  uint64_t capacity_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<T*> bases_;  // chunks_[c].get(), for RowIn
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_ARENA_H_
