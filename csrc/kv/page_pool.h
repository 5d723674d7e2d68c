// Copyright keras_rec_emb authors. Apache-2.0.
//
// Memory for the tables' indexes and row arenas, on transparent huge pages.
//
// A lookup touches an index line and a row line at random over all of a
// table's memory. On 4 KiB pages a table past the TLB's reach (~8 MiB)
// makes nearly every such touch miss the TLB too and wait for a page walk,
// and a core runs few walks at once; on 2 MiB pages both the index and
// the rows miss far less (measurements: docs/history.md, session 18).
// A shard's index and chunks are mostly far smaller than 2 MiB, so they
// are carved out of shared 2 MiB slabs:
//
// * blocks of 4 KiB to 2 MiB: a buddy allocator over 2 MiB slabs (each
//   mapped 2 MiB-aligned and madvise(MADV_HUGEPAGE)); a block of a size
//   that is not a power of two takes the power of two above it and gives
//   its tail back, so it wastes less than 4 KiB; freed blocks merge with
//   their buddies, a slab left wholly free is unmapped (one is kept);
// * blocks over 2 MiB: a mapping of their own, 2 MiB-aligned, madvised;
// * blocks under 4 KiB (small shards' first chunks and indexes): operator
//   new, 64-byte aligned.
//
// Every block is at least 64-byte aligned. Callers free a block with the
// size they asked for. Blocks come back uninitialised, as from operator
// new. Thread-safe (one mutex: blocks are taken when an index or arena
// grows, not per key).
//
// Off (every block from operator new) when KRE_HUGE_PAGES=0 is set in the
// environment before the first table is made, or when the kernel has no
// transparent huge pages or has them set to "never". Under AddressSanitizer
// the free parts of the slabs are poisoned, so a use after free is still
// caught.
#ifndef KRE_KV_PAGE_POOL_H_
#define KRE_KV_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>

namespace kre {
namespace kv {

struct PagePoolStats {
  uint64_t slabs = 0;             // 2 MiB slabs mapped
  uint64_t slab_bytes_used = 0;   // bytes of the slabs handed out (4 KiB multiples)
  uint64_t large_bytes = 0;       // bytes mapped for blocks over 2 MiB
  uint64_t madvise_failures = 0;  // mappings the kernel would not mark for huge pages
};

class PagePool {
 public:
  static constexpr int kMinOrder = 12;   // 4 KiB
  static constexpr int kSlabOrder = 21;  // 2 MiB
  static constexpr size_t kMinBlock = size_t{1} << kMinOrder;
  static constexpr size_t kSlab = size_t{1} << kSlabOrder;
  static constexpr size_t kAlign = 64;
  static_assert(kSlab == size_t{2} << 20, "a slab is one x86-64 huge page");
  static_assert(kMinOrder < kSlabOrder && kAlign <= kMinBlock,
                "a buddy block of any order is kAlign-aligned inside its slab");

  // A pool that pools (`enabled`) or hands every block to operator new.
  explicit PagePool(bool enabled);
  // Unmaps the slabs (blocks still out become invalid).
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A block of `bytes`, 64-byte aligned (4 KiB-aligned from 4 KiB up);
  // throws std::bad_alloc.
  void* Allocate(size_t bytes);
  // Frees a block of Allocate(bytes); p may be null.
  void Free(void* p, size_t bytes) noexcept;

  bool enabled() const { return enabled_; }
  PagePoolStats Stats() const;

  // The process's pool, for the tables (never destroyed: a table may be
  // freed during static destruction).
  static PagePool& Global();
  // Whether the environment and the kernel allow huge pages (see above).
  static bool HugePagesAvailable();

 private:
  static constexpr int kOrders = kSlabOrder - kMinOrder + 1;
  uintptr_t MapSlabLocked();
  void FreeRangeLocked(uintptr_t addr, size_t n);
  void FreeBlockLocked(uintptr_t addr, int order);
  void* MapLarge(size_t bytes);
  void UnmapLarge(void* p, size_t bytes) noexcept;

  const bool enabled_;
  mutable std::mutex mu_;
  std::set<uintptr_t> free_[kOrders];  // free blocks by order, lowest first
  std::set<uintptr_t> slabs_;
  uint64_t slab_bytes_used_ = 0;
  uint64_t large_bytes_ = 0;
  uint64_t madvise_failures_ = 0;
};

// A std allocator over PagePool::Global(), for the shard indexes.
template <typename T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <typename U>
  PoolAllocator(const PoolAllocator<U>&) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(PagePool::Global().Allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { PagePool::Global().Free(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const PoolAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const PoolAllocator<U>&) const {
    return false;
  }
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_PAGE_POOL_H_
