// The machine's floor for random row access: plain loops, no framework.
//
// Measures, over arrays of the workload's size and row width, on T threads:
//   probe:  one lookup of a random present key in an open-addressing table
//           (int64 keys -> uint32 row ids, linear probing, load 0.5), the
//           hash probe every table lookup pays;
//   gather: a copy of one random row (dim floats) into a dense output;
//   rmw:    Adagrad's update of one random row and its accumulator row, read
//           and written (acc += g*g; row -= lr * g / sqrt(acc + eps)).
// Rows of 64 bytes and more span whole cache lines; each access is
// prefetched a few iterations ahead, as a kernel that knows its positions
// does. Row positions are uniform over the table (worst case: no reuse in cache).
// Prints one JSON object: ops per second per kind.
//
// Build: g++ -O3 -march=native -fno-math-errno -pthread -o probe probe.cc
// (-fno-math-errno lets the update's sqrt vectorize).
// Run:   probe ROWS DIM THREADS OPS
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Anonymous memory on transparent huge pages where the kernel allows it, as
// the package's own tables are (KRE_HUGE_PAGES defaults on).
void* Map(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

template <typename Fn>
double Run(int threads, uint64_t ops, Fn fn) {
  std::vector<std::thread> pool;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  uint64_t per = ops / threads;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      fn(t, per);
    });
  }
  while (ready.load() < threads) {
  }
  t0 = std::chrono::steady_clock::now();
  go.store(true);
  for (auto& th : pool) th.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(per * threads) / s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: probe ROWS DIM THREADS OPS\n");
    return 2;
  }
  const uint64_t rows = std::strtoull(argv[1], nullptr, 10);
  const int dim = std::atoi(argv[2]);
  const int threads = std::atoi(argv[3]);
  const uint64_t ops = std::strtoull(argv[4], nullptr, 10);
  if (rows < 1024 || dim < 1 || threads < 1 || ops < 1000) {
    std::fprintf(stderr, "probe: bad arguments\n");
    return 2;
  }
  // Open-addressing index at load 0.5: keys are Mix(i) | 1 (never 0, the
  // empty marker), slot = hash & mask, 16-byte slots (key, row).
  uint64_t cap = 1;
  while (cap < rows * 2) cap <<= 1;
  const uint64_t mask = cap - 1;
  struct Slot {
    uint64_t key;
    uint64_t row;
  };
  auto* index = static_cast<Slot*>(Map(cap * sizeof(Slot)));
  for (uint64_t i = 0; i < rows; ++i) {
    uint64_t key = Mix(i) | 1;
    uint64_t s = Mix(key) & mask;
    while (index[s].key != 0) s = (s + 1) & mask;
    index[s] = {key, i};
  }
  const size_t row_bytes = sizeof(float) * dim;
  auto* values = static_cast<float*>(Map(rows * row_bytes));
  auto* acc = static_cast<float*>(Map(rows * row_bytes));
  for (uint64_t i = 0; i < rows * dim; ++i) {
    values[i] = static_cast<float>(i % 97) * 1e-3f;
    acc[i] = 0.1f;
  }
  std::vector<uint64_t> sink(threads * 8, 0);
  // Every thread's random positions and keys, drawn before timing: what is
  // timed is the access, not the drawing (the lists are read in order).
  const uint64_t per = ops / threads;
  std::vector<std::vector<uint64_t>> positions(threads), keys(threads);
  for (int t = 0; t < threads; ++t) {
    positions[t].resize(per);
    keys[t].resize(per);
    uint64_t x = 0x1234 + 7919 * t;
    for (uint64_t j = 0; j < per; ++j) {
      positions[t][j] = Mix(x++) % rows;
      keys[t][j] = Mix(positions[t][j]) | 1;
    }
  }
  const uint64_t kBatch = 4096;
  // Rows asked for this many iterations ahead (software prefetch): how a
  // kernel that knows its positions in advance reaches the memory system's
  // parallelism, as ours and fbgemm's do.
  const uint64_t kAhead = 8;
  // Each thread draws its positions in batches into a small buffer (in
  // cache), so the loop's own cost is the random access.
  auto probe = Run(threads, ops, [&](int t, uint64_t n) {
    const uint64_t* k = keys[t].data();
    uint64_t found = 0;
    for (uint64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) __builtin_prefetch(&index[Mix(k[j + kAhead]) & mask]);
      uint64_t s = Mix(k[j]) & mask;
      while (index[s].key != k[j]) s = (s + 1) & mask;
      found += index[s].row;
    }
    sink[t * 8] = found;
  });
  auto gather = Run(threads, ops, [&](int t, uint64_t n) {
    const uint64_t* pos = positions[t].data();
    std::vector<float> out(kBatch * dim);
    float check = 0;
    for (uint64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) __builtin_prefetch(values + pos[j + kAhead] * dim);
      std::memcpy(&out[(j % kBatch) * dim], values + pos[j] * dim, row_bytes);
      if (j % kBatch == kBatch - 1) check += out[(j / kBatch) % kBatch * dim];
    }
    sink[t * 8 + 1] = static_cast<uint64_t>(check);
  });
  auto rmw = Run(threads, ops, [&](int t, uint64_t n) {
    const uint64_t* pos = positions[t].data();
    const float lr = 0.05f, eps = 1e-16f;
    std::vector<float> grad(dim);
    for (int d = 0; d < dim; ++d) grad[d] = 1e-3f * static_cast<float>(d + 1);
    const float* __restrict g = grad.data();
    for (uint64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        __builtin_prefetch(values + pos[j + kAhead] * dim, 1);
        __builtin_prefetch(acc + pos[j + kAhead] * dim, 1);
      }
      float* __restrict v = values + pos[j] * dim;
      float* __restrict a = acc + pos[j] * dim;
      for (int d = 0; d < dim; ++d) {
        a[d] += g[d] * g[d];
        v[d] -= lr * g[d] / std::sqrt(a[d] + eps);
      }
    }
  });
  uint64_t s = 0;
  for (auto v : sink) s += v;
  std::printf(
      "{\"rows\": %llu, \"dim\": %d, \"threads\": %d, \"ops\": %llu, \"probe_per_s\": %.6g, "
      "\"gather_rows_per_s\": %.6g, \"rmw_rows_per_s\": %.6g, \"checksum\": %llu}\n",
      static_cast<unsigned long long>(rows), dim, threads, static_cast<unsigned long long>(ops),
      probe, gather, rmw, static_cast<unsigned long long>(s & 0xffff));
  return 0;
}
