// Copyright keras_rec_emb authors. Apache-2.0.
#include "kv/page_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KRE_POISON(p, n) ASAN_POISON_MEMORY_REGION(reinterpret_cast<void*>(p), (n))
#define KRE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(reinterpret_cast<void*>(p), (n))
#else
#define KRE_POISON(p, n) ((void)(p), (void)(n))
#define KRE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace kre {
namespace kv {
namespace {

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

int FloorLog2(uint64_t n) { return 63 - __builtin_clzll(n); }

// Maps `bytes` (a multiple of 2 MiB) at a 2 MiB boundary and marks it for
// huge pages; returns nullptr when the kernel has no memory.
void* MapAligned(size_t bytes, uint64_t* madvise_failures) {
  const size_t span = bytes + PagePool::kSlab;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = RoundUp(start, PagePool::kSlab);
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = aligned + bytes;
  if (start + span > end) ::munmap(reinterpret_cast<void*>(end), start + span - end);
  void* p = reinterpret_cast<void*>(aligned);
  if (::madvise(p, bytes, MADV_HUGEPAGE) != 0) ++*madvise_failures;
  return p;
}

}  // namespace

PagePool::PagePool(bool enabled) : enabled_(enabled) {}

PagePool::~PagePool() {
  for (uintptr_t s : slabs_) {
    KRE_UNPOISON(s, kSlab);
    ::munmap(reinterpret_cast<void*>(s), kSlab);
  }
}

bool PagePool::HugePagesAvailable() {
  const char* env = std::getenv("KRE_HUGE_PAGES");
  if (env && std::string(env) == "0") return false;
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  if (!std::getline(f, mode)) return false;
  return mode.find("[never]") == std::string::npos;
}

PagePool& PagePool::Global() {
  static PagePool* pool = new PagePool(HugePagesAvailable());
  return *pool;
}

void* PagePool::Allocate(size_t bytes) {
  if (!enabled_ || bytes < kMinBlock) {
    return ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(kAlign));
  }
  const size_t n = RoundUp(bytes, kMinBlock);
  if (n > kSlab) return MapLarge(n);
  const int k = FloorLog2(n) + ((n & (n - 1)) ? 1 : 0);
  std::lock_guard<std::mutex> lock(mu_);
  int j = k;
  while (j <= kSlabOrder && free_[j - kMinOrder].empty()) ++j;
  uintptr_t block;
  if (j > kSlabOrder) {
    block = MapSlabLocked();
    j = kSlabOrder;
  } else {
    auto& s = free_[j - kMinOrder];
    block = *s.begin();
    s.erase(s.begin());
  }
  // Split down to order k, keeping the lower half, then give back the tail
  // past n of a size that is not a power of two.
  while (j > k) {
    --j;
    free_[j - kMinOrder].insert(block + (uintptr_t{1} << j));
  }
  if (n < (size_t{1} << k)) FreeRangeLocked(block + n, (size_t{1} << k) - n);
  slab_bytes_used_ += n;
  KRE_UNPOISON(block, n);
  return reinterpret_cast<void*>(block);
}

void PagePool::Free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (!enabled_ || bytes < kMinBlock) {
    ::operator delete(p, std::align_val_t(kAlign));
    return;
  }
  const size_t n = RoundUp(bytes, kMinBlock);
  if (n > kSlab) {
    UnmapLarge(p, n);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  slab_bytes_used_ -= n;
  KRE_POISON(p, n);
  FreeRangeLocked(reinterpret_cast<uintptr_t>(p), n);
}

uintptr_t PagePool::MapSlabLocked() {
  void* p = MapAligned(kSlab, &madvise_failures_);
  if (!p) throw std::bad_alloc();
  const uintptr_t s = reinterpret_cast<uintptr_t>(p);
  try {
    slabs_.insert(s);
  } catch (...) {
    ::munmap(p, kSlab);
    throw;
  }
  KRE_POISON(s, kSlab);
  return s;
}

// Frees [addr, addr + n) (4 KiB multiples) as the largest aligned powers of
// two that tile it.
void PagePool::FreeRangeLocked(uintptr_t addr, size_t n) {
  while (n > 0) {
    const int k = std::min(__builtin_ctzll(addr), FloorLog2(n));
    FreeBlockLocked(addr, k);
    addr += uintptr_t{1} << k;
    n -= size_t{1} << k;
  }
}

// Frees the block of `order` at addr, merged with its free buddies; a slab
// left wholly free is unmapped unless it would be the only free one.
void PagePool::FreeBlockLocked(uintptr_t addr, int order) {
  while (order < kSlabOrder) {
    const uintptr_t buddy = addr ^ (uintptr_t{1} << order);
    auto& s = free_[order - kMinOrder];
    auto it = s.find(buddy);
    if (it == s.end()) break;
    s.erase(it);
    addr &= ~(uintptr_t{1} << order);
    ++order;
  }
  auto& s = free_[order - kMinOrder];
  if (order == kSlabOrder && !s.empty()) {
    slabs_.erase(addr);
    KRE_UNPOISON(addr, kSlab);
    ::munmap(reinterpret_cast<void*>(addr), kSlab);
    return;
  }
  // std::set's node allocation can throw only when the process is out of
  // memory; the block is then lost to the pool, not to correctness.
  try {
    s.insert(addr);
  } catch (...) {
  }
}

void* PagePool::MapLarge(size_t bytes) {
  const size_t len = RoundUp(bytes, kSlab);
  uint64_t failures = 0;
  void* p = MapAligned(len, &failures);
  if (!p) throw std::bad_alloc();
  std::lock_guard<std::mutex> lock(mu_);
  large_bytes_ += len;
  madvise_failures_ += failures;
  return p;
}

void PagePool::UnmapLarge(void* p, size_t bytes) noexcept {
  const size_t len = RoundUp(bytes, kSlab);
  ::munmap(p, len);
  std::lock_guard<std::mutex> lock(mu_);
  large_bytes_ -= len;
}

PagePoolStats PagePool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PagePoolStats st;
  st.slabs = slabs_.size();
  st.slab_bytes_used = slab_bytes_used_;
  st.large_bytes = large_bytes_;
  st.madvise_failures = madvise_failures_;
  return st;
}

}  // namespace kv
}  // namespace kre
