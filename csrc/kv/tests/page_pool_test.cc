// Copyright keras_rec_emb authors. Apache-2.0.
// Tests of PagePool (page_pool.h): blocks of every size class hold their
// bytes without overlapping, carry their alignment, merge back into slabs
// that are unmapped, take non-power-of-two sizes without wasting the tail,
// and stay sound under threads; the slabs are marked for huge pages where
// the kernel has them; ChunkedArena's chunks come from the process's pool
// and go back to it. Run by `make test` (also under ASan and TSan).
#include "kv/page_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kv/arena.h"
#include "kv/tests/test_util.h"

using kre::kv::ChunkedArena;
using kre::kv::PagePool;

namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;

uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

struct Block {
  uint8_t* p;
  size_t bytes;
  uint8_t tag;
};

// Fills a block with its tag (first, last and every 512th byte: enough to
// catch two blocks sharing a page, cheap for blocks of megabytes).
void Fill(const Block& b) {
  for (size_t i = 0; i < b.bytes; i += 512) b.p[i] = b.tag;
  b.p[b.bytes - 1] = b.tag;
}
bool Holds(const Block& b) {
  for (size_t i = 0; i < b.bytes; i += 512) {
    if (b.p[i] != b.tag) return false;
  }
  return b.p[b.bytes - 1] == b.tag;
}

size_t RandomSize(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      return 1 + rng() % (4 * kKiB);  // operator new
    case 1:
      return 4 * kKiB + rng() % (60 * kKiB);  // small slab blocks
    case 2:
      return 64 * kKiB + rng() % (2 * kMiB - 64 * kKiB + 1);
    default:
      return 2 * kMiB + 1 + rng() % (3 * kMiB);  // own mapping
  }
}

// Random sizes of every class, all live at once, then freed in random order.
void TestBlocks(bool enabled) {
  PagePool pool(enabled);
  CHECK(pool.enabled() == enabled);
  std::mt19937_64 rng(7);
  std::vector<Block> blocks;
  for (int i = 0; i < 300; ++i) {
    const size_t n = RandomSize(rng);
    Block b{static_cast<uint8_t*>(pool.Allocate(n)), n, static_cast<uint8_t>(1 + i % 251)};
    CHECK(Addr(b.p) % PagePool::kAlign == 0);
    if (enabled && n >= PagePool::kMinBlock) CHECK(Addr(b.p) % PagePool::kMinBlock == 0);
    if (enabled && n > PagePool::kSlab) CHECK(Addr(b.p) % PagePool::kSlab == 0);
    Fill(b);
    blocks.push_back(b);
  }
  bool all_hold = true;
  for (const Block& b : blocks) all_hold = all_hold && Holds(b);
  CHECK(all_hold);
  if (enabled) {
    const auto st = pool.Stats();
    uint64_t slab_bytes = 0, large = 0;
    for (const Block& b : blocks) {
      const size_t n =
          (b.bytes + PagePool::kMinBlock - 1) / PagePool::kMinBlock * PagePool::kMinBlock;
      if (b.bytes < PagePool::kMinBlock) continue;
      if (n > PagePool::kSlab) {
        large += (n + PagePool::kSlab - 1) / PagePool::kSlab * PagePool::kSlab;
      } else {
        slab_bytes += n;
      }
    }
    CHECK(st.slab_bytes_used == slab_bytes);
    CHECK(st.large_bytes == large);
    // Tails given back: the slabs hold at most 2x what is used (a buddy
    // allocator that wasted the power-of-two tail would need up to 4x here).
    CHECK(st.slabs * PagePool::kSlab >= slab_bytes);
    CHECK(st.slabs * PagePool::kSlab <= 2 * slab_bytes + PagePool::kSlab);
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (size_t i = 0; i < blocks.size(); ++i) {
    pool.Free(blocks[i].p, blocks[i].bytes);
    if (i % 50 == 0) {  // the rest still hold their bytes
      bool rest_hold = true;
      for (size_t j = i + 1; j < blocks.size(); ++j) rest_hold = rest_hold && Holds(blocks[j]);
      CHECK(rest_hold);
    }
  }
  const auto st = pool.Stats();
  CHECK(st.slab_bytes_used == 0);
  CHECK(st.large_bytes == 0);
  CHECK(st.slabs <= 1);     // one wholly free slab is kept, the rest unmapped
  pool.Free(nullptr, 123);  // no-op
}

// The buddy rules on one slab: a non-power-of-two block gives its tail
// back, buddies merge into a whole slab that is reused, and a second
// wholly free slab is unmapped.
void TestBuddies() {
  PagePool pool(true);
  void* a = pool.Allocate(12 * kKiB);  // takes 16 KiB, gives back 4 KiB
  void* b = pool.Allocate(4 * kKiB);   // the tail
  CHECK(Addr(b) == Addr(a) + 12 * kKiB);
  CHECK(pool.Stats().slabs == 1);
  CHECK(pool.Stats().slab_bytes_used == 16 * kKiB);
  pool.Free(a, 12 * kKiB);
  pool.Free(b, 4 * kKiB);
  CHECK(pool.Stats().slabs == 1);         // wholly free, kept
  void* whole = pool.Allocate(2 * kMiB);  // merged back: the same slab
  CHECK(Addr(whole) == Addr(a));
  void* halves[4];
  for (auto& h : halves) h = pool.Allocate(kMiB);  // a second slab
  CHECK(pool.Stats().slabs == 3);
  CHECK(Addr(halves[0]) % PagePool::kSlab == 0 && Addr(halves[1]) == Addr(halves[0]) + kMiB);
  for (auto& h : halves) pool.Free(h, kMiB);
  pool.Free(whole, 2 * kMiB);
  CHECK(pool.Stats().slabs == 1);
  CHECK(pool.Stats().slab_bytes_used == 0);
  // Sizes one byte over a 4 KiB multiple round up, not over.
  void* c = pool.Allocate(8 * kKiB + 1);
  void* d = pool.Allocate(4 * kKiB);
  CHECK(Addr(d) == Addr(c) + 12 * kKiB);
  pool.Free(c, 8 * kKiB + 1);
  pool.Free(d, 4 * kKiB);
  CHECK(pool.Stats().slab_bytes_used == 0);
}

// The "THPeligible" of the mapping that holds `p` in /proc/self/smaps (-1
// if the kernel does not say).
int ThpEligible(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(f, line)) {
    unsigned long lo, hi;
    char dash;
    std::istringstream head(line);
    if (line.find(':') == std::string::npos || line.find('-') < line.find(':')) {
      if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
        in = Addr(p) >= lo && Addr(p) < hi;
        continue;
      }
    }
    if (in && line.rfind("THPeligible:", 0) == 0) return std::stoi(line.substr(12));
  }
  return -1;
}

// Where the kernel has transparent huge pages, the slabs and the large
// blocks are marked for them.
void TestHugePages() {
  PagePool pool(true);
  void* slab_block = pool.Allocate(64 * kKiB);
  void* large = pool.Allocate(3 * kMiB);
  std::memset(slab_block, 1, 64 * kKiB);
  std::memset(large, 1, 3 * kMiB);
  CHECK(pool.Stats().madvise_failures == 0);
  if (PagePool::HugePagesAvailable()) {
    const int a = ThpEligible(slab_block), b = ThpEligible(large);
    if (a >= 0 || b >= 0) {
      CHECK(a == 1);
      CHECK(b == 1);
    } else {
      std::printf("page_pool_test: /proc/self/smaps has no THPeligible; not checked\n");
    }
  }
  pool.Free(slab_block, 64 * kKiB);
  pool.Free(large, 3 * kMiB);
}

// Threads taking and freeing blocks of one pool at once.
void TestThreads() {
  PagePool pool(true);
  bool ok[4] = {true, true, true, true};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, &ok, t] {
      std::mt19937_64 rng(100 + t);
      std::vector<Block> live;
      for (int i = 0; i < 400; ++i) {
        if (live.size() < 20 && rng() % 3 != 0) {
          const size_t n = 1 + rng() % (512 * kKiB);
          Block b{static_cast<uint8_t*>(pool.Allocate(n)), n,
                  static_cast<uint8_t>(t * 60 + i % 60)};
          Fill(b);
          live.push_back(b);
        } else if (!live.empty()) {
          const size_t j = rng() % live.size();
          ok[t] = ok[t] && Holds(live[j]);
          pool.Free(live[j].p, live[j].bytes);
          live.erase(live.begin() + static_cast<long>(j));
        }
      }
      for (const Block& b : live) {
        ok[t] = ok[t] && Holds(b);
        pool.Free(b.p, b.bytes);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (bool o : ok) CHECK(o);
  CHECK(pool.Stats().slab_bytes_used == 0);
  CHECK(pool.Stats().slabs <= 1);
}

// ChunkedArena's chunks come from the global pool and go back to it on
// Clear and destruction; a moved arena keeps its rows.
void TestArena() {
  PagePool& g = PagePool::Global();
  const uint64_t before = g.Stats().slab_bytes_used;
  {
    ChunkedArena<float> a(16);
    a.EnsureCapacity(40000, 0.5f);
    for (uint64_t r = 0; r < 40000; r += 7) a.Row(r)[3] = static_cast<float>(r);
    if (g.enabled()) CHECK(g.Stats().slab_bytes_used > before);
    ChunkedArena<float> b(std::move(a));
    CHECK(a.capacity() == 0 && b.capacity() >= 40000);
    bool kept = true;
    for (uint64_t r = 0; r < 40000; r += 7) kept = kept && b.Row(r)[3] == static_cast<float>(r);
    CHECK(kept);
    CHECK(b.Row(39999)[0] == 0.5f);
    ChunkedArena<float> c(4);
    c.EnsureCapacity(100, 1.0f);
    c = std::move(b);  // c's own chunks are freed
    CHECK(c.width() == 16 && c.Row(14)[3] == 14.0f);
    c.Clear();
    CHECK(c.capacity() == 0);
    CHECK(g.Stats().slab_bytes_used == before);
    c.EnsureCapacity(20, 2.0f);
  }  // destroyed with a chunk
  CHECK(g.Stats().slab_bytes_used == before);
}

}  // namespace

int main() {
  TestBlocks(true);
  TestBlocks(false);
  TestBuddies();
  TestHugePages();
  TestThreads();
  TestArena();
  return kre::kv::test::Report("page_pool_test");
}
