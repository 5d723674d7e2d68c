// Copyright keras_rec_emb authors. Apache-2.0.
// Plain C++ tests of the TF-free table. Run by `make test` (also under ASan).
#include "kv/table.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "kv/partition.h"
#include "kv/tests/test_util.h"

using kre::kv::BloomSizing;
using kre::kv::test::Exported;

namespace {

constexpr int64_t kDim = 4;
constexpr int64_t kDefaultDim = 7;

std::vector<float> Defaults() {
  std::vector<float> d(kDefaultDim * kDim);
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<float>(i) * 0.5f;
  return d;
}

template <typename K>
void TestInsertFindDefaultRows() {
  Table<K> t(kDim, Defaults(), 4);
  std::vector<K> keys = {3, 10, 3, -2, 0};
  int64_t inserted = 0;
  std::vector<float> out = Lookup(t, keys, /*insert=*/true, &inserted);
  CHECK(inserted == 4);
  CHECK(t.Size() == 4);
  for (size_t i = 0; i < keys.size(); ++i) {
    int64_t r = static_cast<int64_t>(keys[i]) % kDefaultDim;
    if (r < 0) r += kDefaultDim;
    for (int64_t d = 0; d < kDim; ++d) {
      CHECK(out[i * kDim + d] == (r * kDim + d) * 0.5f);
    }
  }
  std::vector<float> v;
  int64_t freq = 0, version = 0;
  CHECK(t.Find(3, &v, &freq, &version));
  CHECK(freq == 2);
  CHECK(version == 0);
  // Lookup without insert leaves the table alone and reads default rows.
  std::vector<K> missing = {100, 3};
  out = Lookup(t, missing, /*insert=*/false);
  CHECK(t.Size() == 4);
  CHECK(out[0] == (100 % kDefaultDim) * kDim * 0.5f);
  CHECK(!t.Find(100, &v, &freq, &version));
  CHECK(t.Find(3, &v, &freq, &version) && freq == 2);
}

void TestGrowManyKeys() {
  Table<int64_t> t(kDim, Defaults(), 8);
  std::vector<int64_t> keys;
  for (int64_t i = 0; i < 200000; ++i) keys.push_back(i * 1000003 + (int64_t{1} << 50));
  int64_t inserted = 0;
  Lookup(t, keys, true, &inserted);
  CHECK(inserted == 200000);
  CHECK(t.Size() == 200000);
  std::vector<float> v;
  int64_t f, ver;
  for (int64_t i = 0; i < 200000; i += 997) CHECK(t.Find(keys[i], &v, &f, &ver) && f == 1);
  CHECK(!t.Find(5, &v, &f, &ver));
}

void TestEraseReusesRows() {
  Table<int64_t> t(kDim, Defaults(), 2);
  std::vector<int64_t> keys;
  for (int64_t i = 0; i < 5000; ++i) keys.push_back(i);
  Lookup(t, keys, true);
  // Evict and re-admit a rolling window of new keys many times: after the
  // first rounds (the index may double once when tombstones first force a
  // rehash) memory must stop growing, because rows come back from the free
  // list and tombstones are cleared by same-size rehashes.
  uint64_t mem = 0;
  for (int round = 1; round <= 20; ++round) {
    if (round == 3) mem = t.MemoryBytes();
    for (int64_t i = 0; i < 5000; ++i) CHECK(t.Erase(keys[i]));
    CHECK(t.Size() == 0);
    for (auto& k : keys) k += 5000;
    Lookup(t, keys, true);
    CHECK(t.Size() == 5000);
  }
  CHECK(t.MemoryBytes() == mem);
  CHECK(!t.Erase(-1));
  std::vector<float> v;
  int64_t f, ver;
  CHECK(t.Find(keys[17], &v, &f, &ver));
  CHECK(!t.Find(17, &v, &f, &ver));
}

void TestSlotsApplyDedupe() {
  Table<int64_t> t(kDim, Defaults(), 4);
  std::vector<int64_t> keys = {5, 9, 5, 5};
  Lookup(t, keys, true);
  const int acc = t.AddSlot("accumulator", kDim, 0.1f);
  CHECK(acc == 0);
  CHECK(t.AddSlot("accumulator", kDim, 0.2f) == 0);  // idempotent
  CHECK(t.SlotIndex("accumulator") == 0 && t.SlotIndex("nope") == -1);
  bool threw = false;
  try {
    t.AddSlot("accumulator", 1, 0.0f);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  std::vector<float> grads(keys.size() * kDim);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = 1.0f + i % kDim;
  auto p = Partition(t, keys.data(), keys.size(), 2, Serial);
  int calls = 0;
  std::map<float, int> seen;  // row's first value -> count of calls
  for (int s = 0; s < t.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    t.Apply(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, p.offsets[s + 1] - b,
            grads.data(), {acc}, /*step=*/7, [&](float* value, float** slots, const float* g) {
              ++calls;
              // Existing rows keep the init of their time (0.1).
              CHECK(std::fabs(slots[0][0] - 0.1f) < 1e-7f);
              for (int64_t d = 0; d < kDim; ++d) {
                slots[0][d] += g[d] * g[d];
                value[d] -= g[d];
              }
            });
  }
  CHECK(calls == 2);
  std::vector<float> v;
  int64_t f, ver;
  CHECK(t.Find(5, &v, &f, &ver));
  CHECK(ver == 7 && f == 3);
  // key 5: default row 5, gradient summed over three occurrences.
  for (int64_t d = 0; d < kDim; ++d) CHECK(v[d] == (5 * kDim + d) * 0.5f - 3.0f * (1 + d));
  // A key inserted after the re-registration starts at the new init (0.2).
  std::vector<int64_t> fresh = {1234};
  Lookup(t, fresh, true);
  CHECK(ExportAll(t).slots.size() == 3 * kDim);
}

void TestExportImportRoundTrip() {
  Table<int32_t> a(kDim, Defaults(), 4);
  std::vector<int32_t> keys;
  for (int32_t i = -50; i < 50; ++i) keys.push_back(i * 7);
  Lookup(a, keys, true);
  a.AddSlot("m", kDim, 0.0f);
  a.AddSlot("p", 1, 1.0f);
  Exported<int32_t> ea = ExportAll(a);
  std::vector<int32_t>& k = ea.keys;
  std::vector<float>& vals = ea.values;
  std::vector<float>& slots = ea.slots;
  std::vector<int64_t>& fr = ea.freqs;
  std::vector<int64_t>& vs = ea.versions;
  CHECK(k.size() == 100);
  for (size_t i = 0; i < k.size(); ++i) {
    fr[i] = k[i] + 1000;
    vs[i] = 3;
    for (int64_t d = 0; d < kDim; ++d) vals[i * kDim + d] = k[i] * 0.25f + d;
    for (int64_t d = 0; d <= kDim; ++d) slots[i * (kDim + 1) + d] = -k[i] - 0.5f * d;
  }
  Table<int32_t> b(kDim, Defaults(), 2);
  const int m = b.AddSlot("m", kDim, 0.0f);
  const int pp = b.AddSlot("p", 1, 1.0f);
  b.Import(k.data(), vals.data(), fr.data(), vs.data(), k.size(), slots.data(), {m, pp}, {kDim, 1});
  CHECK(b.Size() == 100);
  std::vector<float> v;
  int64_t f, ver;
  CHECK(b.Find(-21, &v, &f, &ver));
  CHECK(f == -21 + 1000 && ver == 3 && v[2] == -21 * 0.25f + 2);
  Exported<int32_t> eb = ExportAll(b);
  std::vector<int32_t>& k2 = eb.keys;
  std::vector<float>& slots2 = eb.slots;
  std::map<int32_t, std::vector<float>> s1, s2;
  for (size_t i = 0; i < k.size(); ++i)
    s1[k[i]].assign(&slots[i * (kDim + 1)], &slots[(i + 1) * (kDim + 1)]);
  for (size_t i = 0; i < k2.size(); ++i)
    s2[k2[i]].assign(&slots2[i * (kDim + 1)], &slots2[(i + 1) * (kDim + 1)]);
  CHECK(s1 == s2);
  b.Clear();
  CHECK(b.Size() == 0);
}

void TestPartitionStable() {
  Table<int64_t> t(kDim, Defaults(), 16);
  std::vector<int64_t> keys;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 10000; ++i) keys.push_back(static_cast<int64_t>(rng() % 3000));
  auto p = Partition(t, keys.data(), keys.size(), 5, Serial);
  std::vector<int> seen(keys.size(), 0);
  for (int s = 0; s < 16; ++s) {
    for (int64_t j = p.offsets[s]; j < p.offsets[s + 1]; ++j) {
      CHECK(t.ShardOf(p.hashes[j]) == s);
      CHECK(p.keys[j] == keys[p.order[j]]);
      CHECK(p.hashes[j] == Table<int64_t>::Hash(p.keys[j]));
      if (j > p.offsets[s]) CHECK(p.order[j] > p.order[j - 1]);
      ++seen[p.order[j]];
    }
  }
  for (int c : seen) CHECK(c == 1);
  auto empty = Partition(t, keys.data(), 0, 4, Serial);
  CHECK(empty.offsets[16] == 0);
}

void TestConcurrentReadersWriters() {
  Table<int64_t> t(kDim, Defaults(), 8);
  std::vector<int64_t> base;
  for (int64_t i = 0; i < 20000; ++i) base.push_back(i);
  Lookup(t, base, true);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  // Writers insert overlapping new keys; readers look up the base keys and
  // must always see their default rows (never torn or missing).
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      std::vector<int64_t> keys;
      for (int64_t i = 0; i < 30000; ++i) keys.push_back(100000 + (i * 3 + w) % 50000);
      Lookup(t, keys, true);
    });
  }
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < 5; ++rep) {
        std::vector<float> out = Lookup(t, base, false);
        for (size_t i = 0; i < base.size(); ++i) {
          if (out[i * kDim] != (base[i] % kDefaultDim) * kDim * 0.5f) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  CHECK(t.Size() == 20000 + 50000);
  std::vector<float> v;
  int64_t f, ver, total = 0;
  for (int64_t k = 100000; k < 150000; ++k) {
    if (t.Find(k, &v, &f, &ver)) total += f;
  }
  CHECK(total == 3 * 30000);  // every occurrence counted exactly once
}

void TestArenaRowsAcrossChunkSizes() {
  kre::kv::ChunkedArena<int64_t> arena(3);
  const uint64_t n = kre::kv::ChunkedArena<int64_t>::kGrowingRows + 3 * 16384 + 5;
  arena.EnsureCapacity(n, -1);
  CHECK(arena.capacity() >= n && arena.capacity() < n + 16384);
  for (uint64_t id = 0; id < n; ++id) {
    for (int d = 0; d < 3; ++d) arena.Row(id)[d] = static_cast<int64_t>(id * 3 + d);
  }
  bool ok = true;
  for (uint64_t id = 0; id < n; ++id) {
    for (int d = 0; d < 3; ++d) ok &= arena.Row(id)[d] == static_cast<int64_t>(id * 3 + d);
  }
  CHECK(ok);  // no two ids share memory
  CHECK(arena.BytesAllocated() == arena.capacity() * 3 * sizeof(int64_t));
}

kre::kv::TableOptions FilterOptions(int64_t filter_freq) {
  kre::kv::TableOptions o;
  o.dim = kDim;
  o.default_values = Defaults();
  o.num_shards = 4;
  o.filter_freq = filter_freq;
  o.no_permission_value = -7.0f;
  return o;
}

void TestCounterFilter() {
  Table<int64_t> t(FilterOptions(3));
  std::vector<int64_t> once = {11};
  for (int i = 1; i <= 2; ++i) {
    std::vector<float> out = Lookup(t, once, true);
    CHECK(out[0] == -7.0f);  // not admitted yet
    CHECK(t.Size() == 0 && t.FilteredSize() == 1);
  }
  // Gradients of a key not admitted are dropped, without a row.
  auto p = Partition(t, once.data(), 1, 1, Serial);
  std::vector<float> g(kDim, 1.0f);
  int calls = 0;
  t.Apply(t.ShardOf(p.hashes[0]), p.keys.data(), p.hashes.data(), p.order.data(), 1, g.data(), {},
          5, [&](float*, float**, const float*) { ++calls; });
  CHECK(calls == 0);
  // The third sighting admits (DeepRec: the count before the lookup
  // decides), but still reads the no-permission value; the row from the
  // next lookup on.
  std::vector<float> out = Lookup(t, once, true);
  CHECK(out[0] == -7.0f);
  CHECK(t.Size() == 1 && t.FilteredSize() == 0);
  out = Lookup(t, once, true);
  CHECK(out[0] == (11 % kDefaultDim) * kDim * 0.5f);
  // All occurrences of a key in one batch read the same value.
  Table<int64_t> b(FilterOptions(3));
  std::vector<int64_t> four = {5, 5, 5, 5};
  out = Lookup(b, four, true);
  for (int i = 0; i < 4; ++i) CHECK(out[i * kDim] == -7.0f);
  CHECK(b.Size() == 1);
  out = Lookup(b, four, true);
  for (int i = 0; i < 4; ++i) CHECK(out[i * kDim] == (5 % kDefaultDim) * kDim * 0.5f);
  std::vector<float> v;
  int64_t f, ver;
  CHECK(t.Find(11, &v, &f, &ver) && f == 4 && v.size() == kDim);
  // Inference never admits and reads the no-permission value.
  std::vector<int64_t> fresh = {99, 99, 99};
  out = Lookup(t, fresh, false);
  CHECK(out[0] == -7.0f && t.FilteredSize() == 0);
  // A filtered key costs no value row: counted keys take less memory than
  // the same keys admitted, by at least their rows.
  Table<int64_t> u(FilterOptions(2));
  kre::kv::TableOptions no_filter = FilterOptions(0);
  Table<int64_t> admitted_all(no_filter);
  std::vector<int64_t> keys;
  for (int64_t i = 0; i < 5000; ++i) keys.push_back(i);
  Lookup(u, keys, true);
  Lookup(admitted_all, keys, true);
  CHECK(u.FilteredSize() == 5000 && admitted_all.Size() == 5000);
  CHECK(admitted_all.MemoryBytes() - u.MemoryBytes() >= 5000 * kDim * sizeof(float));
  Lookup(u, keys, true);
  CHECK(u.Size() == 5000 && u.FilteredSize() == 0);
  CHECK(u.MemoryBytes() == admitted_all.MemoryBytes());
  // Export splits admitted and filtered keys; ImportFiltered restores counts.
  std::vector<int64_t> seen_once = {77777};
  Lookup(u, seen_once, true);
  Exported<int64_t> x = ExportAll(u);
  CHECK(x.keys.size() == 5000);
  CHECK(x.keys_f.size() == 1);
  CHECK(x.keys_f[0] == 77777);
  CHECK(x.freqs_f[0] == 1);
  Table<int64_t> w(FilterOptions(2));
  w.ImportFiltered(x.keys_f.data(), x.freqs_f.data(), x.versions_f.data(), 1);
  CHECK(w.FilteredSize() == 1);
  out = Lookup(w, seen_once, true);  // 1 + 1 reaches the threshold: admitted
  CHECK(w.Size() == 1 && out[0] == -7.0f);
  out = Lookup(w, seen_once, true);
  CHECK(out[0] == (77777 % kDefaultDim) * kDim * 0.5f);
}

// DeepRec's default with a filter (no TF_RECORD_FREQ): a key's frequency
// stops at filter_freq; freq_cap = 0 counts every occurrence.
void TestFreqCap() {
  kre::kv::TableOptions o = FilterOptions(3);
  o.freq_cap = 3;
  Table<int64_t> t(o);
  std::vector<int64_t> key = {8};
  std::vector<float> v;
  int64_t f, ver;
  for (int i = 0; i < 5; ++i) Lookup(t, key, true);
  CHECK(t.Find(8, &v, &f, &ver) && f == 3);
  std::vector<int64_t> batch = {9, 9, 9, 9, 9};  // one lookup past the cap
  Lookup(t, batch, true);
  CHECK(t.Find(9, &v, &f, &ver) && f == 3 && t.Size() == 2);
  // A count restored above the cap is kept, not lowered.
  std::vector<int64_t> k = {10};
  std::vector<float> row(kDim, 1.0f);
  std::vector<int64_t> freqs = {50}, versions = {0};
  t.Import(k.data(), row.data(), freqs.data(), versions.data(), 1, nullptr, {}, {});
  Lookup(t, k, true);
  CHECK(t.Find(10, &v, &f, &ver) && f == 50);
  // The Bloom filter's admitted keys stop at the cap too.
  kre::kv::TableOptions b = FilterOptions(3);
  BloomSizing(100, 0.01, &b.bloom_counters, &b.bloom_hashes);
  b.freq_cap = 3;
  Table<int64_t> u(b);
  for (int i = 0; i < 6; ++i) Lookup(u, key, true);
  CHECK(u.Find(8, &v, &f, &ver) && f == 3);
  kre::kv::TableOptions all = FilterOptions(3);
  Table<int64_t> w(all);
  for (int i = 0; i < 5; ++i) Lookup(w, key, true);
  CHECK(w.Find(8, &v, &f, &ver) && f == 5);
}

// This process's resident memory (VmRSS of /proc/self/status), bytes.
uint64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) kb = std::strtoull(line + 6, nullptr, 10);
  }
  std::fclose(f);
  return kb << 10;
}

// DeepRec's modelzoo setting (2**30 keys at p = 0.01, uint64 counters)
// sizes 76.7 GiB of counters: building the table and counting keys holds
// memory for the pages written only, and admission matches exact counting.
void TestBloomMemoryFollowsWrites() {
  kre::kv::TableOptions o = FilterOptions(3);
  BloomSizing(uint64_t{1} << 30, 0.01, &o.bloom_counters, &o.bloom_hashes);
  o.bloom_counter_bytes = 8;
  const uint64_t full = o.bloom_counters * 8;
  CHECK(full > (uint64_t{76} << 30));
  const uint64_t before = ResidentBytes();
  Table<int64_t> t(o);
  Table<int64_t> exact(FilterOptions(3));  // the counter filter counts exactly
  std::vector<int64_t> keys(2000);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<int64_t>(i * 7919);
  for (int round = 0; round < 4; ++round) {
    CHECK(Lookup(t, keys, true) == Lookup(exact, keys, true));
    CHECK(t.Size() == exact.Size());
  }
  CHECK(t.Size() == static_cast<int64_t>(keys.size()));
  CHECK(t.BloomCount(keys[5]) == 3 && t.BloomCount(1) == 0);  // admitted at 3
  const uint64_t grown = ResidentBytes() - before;
  std::printf("bloom of %.1f GiB: table memory %.1f MiB, resident grew %.1f MiB\n",
              full / 1073741824.0, t.MemoryBytes() / 1048576.0, grown / 1048576.0);
  CHECK(t.MemoryBytes() < (uint64_t{200} << 20));
  CHECK(grown < (uint64_t{400} << 20));  // sanitizers' shadow memory included
  // The state streams without being built; its size is the filter's.
  CHECK(t.BloomStateBytes() == full + 8);
  t.Clear();
  CHECK(t.MemoryBytes() < (uint64_t{8} << 20));
  CHECK(t.BloomCount(keys[5]) == 0);
}

// State, VisitState and SetState of a filter with pages never written
// (they read as zeros and stay unallocated after a restore); SwapCounters.
void TestBloomStatePages() {
  using kre::kv::CountingBloomFilter;
  const uint64_t m = 1 << 20;  // 1 MiB of 1-byte counters: 256 pages of 4 KiB
  CountingBloomFilter a(m, 3, 1), b(m, 3, 1), c(m, 3, 1);
  const uint64_t empty = a.MemoryBytes();
  for (uint64_t h = 0; h < 20; ++h) a.Add(h * 0x9e3779b97f4a7c15ULL);
  for (uint64_t h = 0; h < 5; ++h) a.Add(h * 0x9e3779b97f4a7c15ULL);
  CHECK(a.MemoryBytes() > empty && a.MemoryBytes() <= empty + 60 * 4096 * 16);
  const std::vector<uint8_t> state = a.State();
  CHECK(state.size() == a.StateBytes() && state.size() == m + 8);
  std::vector<uint8_t> visited;
  a.VisitState([&](const uint8_t* p, size_t n) { visited.insert(visited.end(), p, p + n); });
  CHECK(visited == state);
  uint64_t nonzero = 0;
  for (size_t i = 0; i < m; ++i) nonzero += state[i] != 0;
  CHECK(nonzero > 0 && nonzero <= 60);
  CHECK(b.SetState(state));
  CHECK(b.State() == state);
  CHECK(b.MemoryBytes() <= a.MemoryBytes());
  for (uint64_t h = 0; h < 40; ++h) {
    CHECK(b.Count(h * 0x9e3779b97f4a7c15ULL) == a.Count(h * 0x9e3779b97f4a7c15ULL));
  }
  CHECK(a.Count(0) == 2 && a.Count(0x9e3779b97f4a7c15ULL * 10) == 1);
  CHECK(!b.SetState(state.data(), state.size() - 1));
  c.SwapCounters(b);
  CHECK(c.State() == state && b.MemoryBytes() == empty && b.Count(0) == 0);
  c.Clear();
  CHECK(c.MemoryBytes() == empty && c.Count(0) == 0 &&
        c.State() == CountingBloomFilter(m, 3, 1).State());
}

void TestBloomFilter() {
  kre::kv::TableOptions o = FilterOptions(2);
  const uint64_t n = 20000;
  BloomSizing(n, 0.01, &o.bloom_counters, &o.bloom_hashes);
  CHECK(o.bloom_hashes == 7);  // round(m/n ln 2) for p = 1%
  o.bloom_counter_bytes = 1;
  Table<int64_t> t(o);
  std::vector<int64_t> keys;
  for (uint64_t i = 0; i < n; ++i) keys.push_back(static_cast<int64_t>(i) * 3);
  std::vector<float> out = Lookup(t, keys, true);
  CHECK(t.Size() < 600);         // only false positives get in on first sight
  CHECK(t.FilteredSize() == 0);  // a Bloom filter keeps no index entries
  // False-positive rate: never-seen keys that the filter already counts.
  int fp = 0;
  const int probes = 100000;
  for (int i = 0; i < probes; ++i) fp += t.BloomCount(static_cast<int64_t>(i) * 3 + 1) > 0;
  const double rate = static_cast<double>(fp) / probes;
  std::printf("bloom false-positive rate %.4f (requested 0.01)\n", rate);
  CHECK(rate > 0.005 && rate < 0.02);
  Lookup(t, keys, true);
  CHECK(t.Size() == static_cast<int64_t>(n));
  // Counters saturate at the counter type's maximum (a key that is never
  // admitted keeps being counted in the filter).
  kre::kv::TableOptions never = o;
  never.filter_freq = 1000;
  Table<int64_t> h(never);
  std::vector<int64_t> hot(300, 5);
  Lookup(h, hot, true);
  CHECK(h.BloomCount(5) == 255 && h.Size() == 0);
  // State round trip.
  Table<int64_t> u(never);
  CHECK(u.SetBloomState(h.BloomState()));
  CHECK(u.BloomCount(5) == 255 && u.BloomCount(6) < 255);
  CHECK(!u.SetBloomState(std::vector<uint8_t>(3)));
  // One filter for the table: the rate holds with a tiny filter split over
  // many shards (DeepRec's tests: n = 5, m = 48, k = 7).
  kre::kv::TableOptions tiny = FilterOptions(2);
  tiny.num_shards = 32;
  BloomSizing(5, 0.01, &tiny.bloom_counters, &tiny.bloom_hashes);
  CHECK(tiny.bloom_counters == 48 && tiny.bloom_hashes == 7);
  Table<int64_t> small(tiny);
  std::vector<int64_t> five = {1, 2, 3, 4, 5};
  Lookup(small, five, true);
  CHECK(small.Size() == 0);  // one sighting each: none admitted
  Lookup(small, five, true);
  CHECK(small.Size() == 5);
}

void TestAnyShardCount() {
  for (int shards : {1, 3, 20, 1000}) {
    Table<int64_t> t(kDim, Defaults(), shards);
    std::vector<int64_t> keys;
    for (int64_t i = 0; i < 5000; ++i) keys.push_back(i * 7);
    Lookup(t, keys, true);
    CHECK(t.Size() == 5000);
    std::vector<int> per(shards, 0);
    for (int64_t k : keys) ++per[t.ShardOf(Table<int64_t>::Hash(k))];
    for (int s = 0; s < shards; ++s) CHECK(shards > 100 || per[s] > 5000 / shards / 2);
    std::vector<float> out = Lookup(t, keys, false);
    CHECK(out[kDim] == (7 % kDefaultDim) * kDim * 0.5f);
  }
}

void TestEviction() {
  Table<int64_t> t(kDim, Defaults(), 4);
  std::vector<int64_t> keys = {1, 2, 3, 4};
  Lookup(t, keys, true);
  auto p = Partition(t, keys.data(), 2, 1, Serial);  // keys 1 and 2 trained at step 10
  std::vector<float> g(2 * kDim, 0.0f);
  for (int s = 0; s < t.num_shards(); ++s) {
    t.Apply(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s],
            p.order.data() + p.offsets[s], p.offsets[s + 1] - p.offsets[s], g.data(), {}, 10,
            [](float*, float**, const float*) {});
  }
  CHECK(t.LatestStep() == 10);
  CHECK(t.Evict(-1, 5, -1.0f) == 2);  // 3 and 4 were never updated (version 0)
  CHECK(t.Size() == 2);
  std::vector<float> v;
  int64_t f, ver;
  CHECK(t.Find(1, &v, &f, &ver) && !t.Find(3, &v, &f, &ver));
  // L2 (DeepRec's rule, 0.5 * sum(v**2) < threshold): default row 0 has
  // 0.5 * 3.5 = 1.75, rows 1 and 2 more than 12.
  std::vector<int64_t> zero = {0};
  Lookup(t, zero, true);
  CHECK(t.Evict(-1, -1, 2.0f) == 1);
  CHECK(!t.Find(0, &v, &f, &ver) && t.Find(1, &v, &f, &ver));
  // A stream of new keys evicted at the rate it arrives: memory plateaus.
  Table<int64_t> u(FilterOptions(2));
  Table<int64_t> kept(FilterOptions(2));  // the same stream, never evicted
  uint64_t mem_after_warmup = 0;
  for (int64_t step = 1; step <= 40; ++step) {
    std::vector<int64_t> batch;
    for (int64_t i = 0; i < 1000; ++i) batch.push_back(step * 1000 + i);
    Lookup(kept, batch, true);
    Lookup(kept, batch, true);
    Lookup(u, batch, true);
    Lookup(u, batch, true);  // admitted
    std::vector<float> grads(batch.size() * kDim, 0.0f);
    auto q = Partition(u, batch.data(), batch.size(), 1, Serial);
    for (int s = 0; s < u.num_shards(); ++s) {
      u.Apply(s, q.keys.data() + q.offsets[s], q.hashes.data() + q.offsets[s],
              q.order.data() + q.offsets[s], q.offsets[s + 1] - q.offsets[s], grads.data(), {},
              step, [](float*, float**, const float*) {});
    }
    u.Evict(-1, 2, -1.0f);
    // (A shard's index may still double once while the live count
    // fluctuates around its growth point; by step 30 it has settled.)
    if (step == 30) mem_after_warmup = u.MemoryBytes();
    if (step > 30) CHECK(u.MemoryBytes() == mem_after_warmup);
  }
  CHECK(u.Size() == 3000);  // steps 38..40 live
  CHECK(kept.Size() == 40000);
  CHECK(mem_after_warmup * 3 < kept.MemoryBytes());
}

// Frequencies and versions from a checkpoint may be any int64: comparisons
// saturate instead of wrapping (UBSan in test-kv-asan also flags overflow).
void TestSaturatingMetadata() {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Table<int64_t> t(FilterOptions(3));
  std::vector<int64_t> keys = {1, 2};
  std::vector<float> vals(2 * kDim, 1.0f);
  std::vector<int64_t> freqs = {5, 5}, versions = {kMin, 5};
  t.Import(keys.data(), vals.data(), freqs.data(), versions.data(), 2, nullptr, {}, {});
  CHECK(t.Evict(10, 100, -1.0f) == 1);  // 10 - INT64_MIN is older than any limit
  std::vector<float> v;
  int64_t f, ver;
  CHECK(!t.Find(1, &v, &f, &ver) && t.Find(2, &v, &f, &ver));
  // A filtered key counted INT64_MAX times stays admitted-worthy, not negative.
  std::vector<int64_t> fk = {7}, ff = {kMax}, fv = {kMax};
  t.ImportFiltered(fk.data(), ff.data(), fv.data(), 1);
  Lookup(t, fk, true);  // the step after INT64_MAX saturates too
  CHECK(t.Find(7, &v, &f, &ver) && f == kMax && t.Size() == 2);
  std::vector<int64_t> nk = {9}, nf = {kMin}, nv = {0};
  t.ImportFiltered(nk.data(), nf.data(), nv.data(), 1);
  Lookup(t, nk, true);  // threshold - INT64_MIN saturates; still counted
  CHECK(t.Find(9, &v, &f, &ver) && f == kMin + 1);
  std::vector<int64_t> k3 = {3}, f3 = {5}, v3 = {kMax};
  t.Import(k3.data(), vals.data(), f3.data(), v3.data(), 1, nullptr, {}, {});
  CHECK(t.LatestStep() == kMax);
  std::vector<int64_t> k11 = {11};
  Lookup(t, k11, true);              // the step after INT64_MAX stays INT64_MAX
  CHECK(t.Evict(0, 0, -1.0f) == 0);  // 0 - INT64_MAX: updated after step 0, not stale
  t.Evict(-1, 0, -1.0f);             // at step INT64_MAX, key 2 (step 5) is stale, key 3 is not
  CHECK(!t.Find(2, &v, &f, &ver) && t.Find(3, &v, &f, &ver));
}

// LookupCounted over distinct keys with counts must leave the table exactly
// as per-occurrence Lookup does, and give each occurrence the same row.
void CheckCountedMatchesPerOccurrence(const kre::kv::TableOptions& o, uint64_t seed) {
  Table<int64_t> one(o), counted(o);
  std::mt19937_64 rng(seed);
  for (int step = 0; step < 6; ++step) {
    // A batch with heavy repeats: ids 0..39, some many times.
    std::vector<int64_t> batch;
    const int n = 150 + static_cast<int>(rng() % 100);
    for (int i = 0; i < n; ++i) {
      const uint64_t r = rng() % 1000;
      batch.push_back(static_cast<int64_t>(r < 700 ? r % 8 : r % 40));
    }
    const std::vector<float> want = Lookup(one, batch, true);
    // Distinct keys in first-seen order, their counts, each occurrence's key.
    std::map<int64_t, int32_t> index;
    std::vector<int64_t> uniq;
    std::vector<int32_t> counts, inverse;
    for (int64_t k : batch) {
      auto it = index.find(k);
      if (it == index.end()) {
        it = index.emplace(k, static_cast<int32_t>(uniq.size())).first;
        uniq.push_back(k);
        counts.push_back(0);
      }
      inverse.push_back(it->second);
      ++counts[it->second];
    }
    auto p = Partition(counted, uniq.data(), uniq.size(), 2, Serial);
    std::vector<float> rows(uniq.size() * kDim, -1.0f);
    for (int s = 0; s < counted.num_shards(); ++s) {
      const int64_t b = p.offsets[s];
      counted.LookupCounted(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                            counts.data(), p.offsets[s + 1] - b, true, rows.data());
    }
    bool same_rows = true;
    for (size_t j = 0; j < batch.size(); ++j) {
      const float* got = &rows[inverse[j] * kDim];
      for (int64_t d = 0; d < kDim; ++d) same_rows &= got[d] == want[j * kDim + d];
    }
    CHECK(same_rows);
    CHECK(one.Size() == counted.Size());
    CHECK(one.Counters().lookups == counted.Counters().lookups);
    CHECK(one.Counters().hits == counted.Counters().hits);
    CHECK(one.FilteredSize() == counted.FilteredSize());
    const auto a = ExportAll(one), b = ExportAll(counted);
    std::map<int64_t, std::pair<int64_t, int64_t>> ma, mb;
    for (size_t i = 0; i < a.keys.size(); ++i) ma[a.keys[i]] = {a.freqs[i], a.versions[i]};
    for (size_t i = 0; i < b.keys.size(); ++i) mb[b.keys[i]] = {b.freqs[i], b.versions[i]};
    for (size_t i = 0; i < a.keys_f.size(); ++i) ma[~a.keys_f[i]] = {a.freqs_f[i], 0};
    for (size_t i = 0; i < b.keys_f.size(); ++i) mb[~b.keys_f[i]] = {b.freqs_f[i], 0};
    CHECK(ma == mb);
    CHECK(one.BloomState() == counted.BloomState());
  }
}

void TestLookupCounted() {
  kre::kv::TableOptions plain = FilterOptions(0);
  CheckCountedMatchesPerOccurrence(plain, 1);
  CheckCountedMatchesPerOccurrence(FilterOptions(5), 2);
  CheckCountedMatchesPerOccurrence(FilterOptions(40), 3);
  kre::kv::TableOptions bloom = FilterOptions(6);
  // Large enough that the 40 keys (0 included) share no counter: with
  // shared counters the estimates depend on how occurrences of different
  // keys interleave, which distinct keys with counts cannot reproduce.
  bloom.bloom_counters = 1 << 16;
  bloom.bloom_hashes = 3;
  bloom.bloom_counter_bytes = 1;
  CheckCountedMatchesPerOccurrence(bloom, 4);
  bloom.filter_freq = 250;  // near the uint8 saturation at 255
  CheckCountedMatchesPerOccurrence(bloom, 5);
  bloom.bloom_counter_bytes = 8;
  bloom.track_meta = false;
  bloom.filter_freq = 3;
  CheckCountedMatchesPerOccurrence(bloom, 6);
  // Key 0 (hash 0) once counted k times per sighting: one sighting is 1.
  Table<int64_t> zero(bloom);
  Lookup(zero, std::vector<int64_t>{0}, true);
  CHECK(zero.BloomCount(0) == 1);
}

// LookupOrdered (batch order, strided output) and OrderedReader (row
// pointers) against Partition + Lookup on a twin table: same rows, return
// values, frequencies, versions, counters, with duplicates, new keys,
// inference and training, any shard count, metadata tracked or not, a
// frequency cap.
template <typename K>
void CheckOrderedMatchesLookup(kre::kv::TableOptions o, uint64_t seed) {
  Table<K> a(o), b(o);
  CHECK(a.OrderedLookups());
  std::mt19937_64 rng(seed);
  const int64_t stride = kDim + 3;  // padding columns stay untouched
  for (int round = 0; round < 12; ++round) {
    const int64_t n = static_cast<int64_t>(rng() % 300);
    std::vector<K> keys(n);
    for (auto& k : keys) k = static_cast<K>(static_cast<int64_t>(rng() % 500) - 100);
    const bool insert = round % 3 != 2;
    int64_t inserted_b = 0;
    const std::vector<float> want = Lookup(b, keys, insert, &inserted_b);
    std::vector<float> got(n * stride + 1, -7.0f);
    int64_t inserted_a = 0;
    if (!insert && round % 2 == 1) {
      // OrderedReader: row pointers, found in two calls under one reader.
      std::vector<const float*> rows(n);
      typename Table<K>::OrderedReader reader(a);
      reader.Find(keys.data(), n / 2, rows.data());
      reader.Find(keys.data() + n / 2, n - n / 2, rows.data() + n / 2);
      for (int64_t i = 0; i < n; ++i) std::copy(rows[i], rows[i] + kDim, &got[i * stride]);
    } else {
      inserted_a = a.LookupOrdered(keys.data(), n, insert, got.data(), stride);
    }
    CHECK(inserted_a == inserted_b);
    bool same = true;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < stride; ++d) {
        const float g = got[i * stride + d];
        same &= d < kDim ? g == want[i * kDim + d] : g == -7.0f;
      }
    }
    CHECK(same && got[n * stride] == -7.0f);
    if (round % 4 == 3) {  // an apply moves the rows away from the defaults
      std::vector<float> grads(keys.size() * kDim, 0.25f);
      for (Table<K>* t : {&a, &b}) {
        auto p = Partition(*t, keys.data(), n, 1, kre::kv::test::Serial);
        for (int s = 0; s < t->num_shards(); ++s) {
          const int64_t off = p.offsets[s];
          t->Apply(s, p.keys.data() + off, p.hashes.data() + off, p.order.data() + off,
                   p.offsets[s + 1] - off, grads.data(), {}, round,
                   [](float* v, float**, const float* g) {
                     for (int64_t d = 0; d < kDim; ++d) v[d] -= g[d];
                   });
        }
      }
    }
  }
  CHECK(ExportAll(a) == ExportAll(b));
  const auto ca = a.Counters(), cb = b.Counters();
  CHECK(ca.lookups == cb.lookups && ca.hits == cb.hits && ca.admitted == cb.admitted);
}

void TestLookupOrdered() {
  kre::kv::TableOptions o = FilterOptions(0);
  CheckOrderedMatchesLookup<int64_t>(o, 1);
  CheckOrderedMatchesLookup<int32_t>(o, 2);
  o.num_shards = 1;
  CheckOrderedMatchesLookup<int64_t>(o, 3);
  o.num_shards = 7;
  o.freq_cap = 3;
  CheckOrderedMatchesLookup<int64_t>(o, 4);
  o.track_meta = false;
  CheckOrderedMatchesLookup<int64_t>(o, 5);
  CHECK(!Table<int64_t>(FilterOptions(3)).OrderedLookups());
  // An empty table and an empty batch.
  Table<int64_t> t(FilterOptions(0));
  std::vector<int64_t> k = {5, 5};
  std::vector<float> out(2 * kDim, -1.0f);
  CHECK(t.LookupOrdered(k.data(), 0, true, out.data(), kDim) == 0 && t.Size() == 0);
  CHECK(t.LookupOrdered(k.data(), 2, false, out.data(), kDim) == 0 && t.Size() == 0);
  CHECK(out[0] == Defaults()[5 * kDim]);
  CHECK(t.LookupOrdered(k.data(), 2, true, out.data(), kDim) == 1 && t.Size() == 1);
  std::vector<float> v;
  int64_t f, ver;
  CHECK(t.Find(5, &v, &f, &ver) && f == 2);
}

// LookupOrdered without insert into rows of whole, aligned cache lines
// (streamed, see StreamRow) and into rows that are not (copied): the same
// rows as Lookup, every other column untouched, whatever the width (16 and
// 32 floats stream; 12 never does), stride and alignment.
void TestLookupOrderedStreamed() {
  for (const int64_t dim : {16, 32, 12}) {
    std::vector<float> defaults(kDefaultDim * dim);
    for (size_t i = 0; i < defaults.size(); ++i) defaults[i] = static_cast<float>(i) - 20.5f;
    Table<int64_t> t(dim, defaults, 4);
    std::vector<int64_t> keys;
    for (int64_t k = 0; k < 700; ++k) keys.push_back((k * 7919) % 1000 - 300);
    std::vector<int64_t> stored(keys.begin(), keys.begin() + 400);
    Lookup(t, stored, /*insert=*/true);
    const std::vector<float> want = Lookup(t, keys, /*insert=*/false);
    const int64_t n = static_cast<int64_t>(keys.size());
    for (const int64_t stride : {dim, 3 * dim, dim + 4}) {
      for (const int64_t offset : {0, 4}) {  // floats past a 64-byte boundary
        const size_t floats = static_cast<size_t>(n * stride + offset + 16);
        float* buf = static_cast<float*>(std::aligned_alloc(64, (floats * 4 + 63) / 64 * 64));
        std::fill(buf, buf + floats, -7.0f);
        float* out = buf + offset;
        CHECK(kre::kv::StreamableRows(out, dim, stride) ==
              (dim % 16 == 0 && stride % 16 == 0 && offset == 0));
        CHECK(t.LookupOrdered(keys.data(), n, /*insert=*/false, out, stride) == 0);
        bool same = true;
        for (size_t i = 0; i < floats; ++i) {
          const int64_t j = static_cast<int64_t>(i) - offset;
          const int64_t row = j / stride, col = j % stride;
          const bool in_row = j >= 0 && row < n && col < dim;
          same &= buf[i] == (in_row ? want[row * dim + col] : -7.0f);
        }
        CHECK(same);
        std::free(buf);
      }
    }
    CHECK(t.Size() == 400);
  }
}

// OrderedReader where its probe's shortcuts could go wrong: shards with no
// index storage yet, key 0 (the key field of a never-used slot), and erased
// keys (a tombstone keeps its key): each gives its default row and no hit;
// the keys still there give their own rows.
void TestOrderedReaderEdges() {
  using Reader = Table<int64_t>::OrderedReader;
  Table<int64_t> t(FilterOptions(0));  // 4 shards
  std::vector<int64_t> probe = {0, 5, -3};
  std::vector<const float*> rows(probe.size());
  {
    Reader(t).Find(probe.data(), 3, rows.data());
  }
  for (size_t i = 0; i < probe.size(); ++i) CHECK(rows[i] == t.DefaultRow(probe[i]));
  CHECK(t.Counters().lookups == 3 && t.Counters().hits == 0);

  std::vector<int64_t> keys;
  for (int64_t k = 1; k <= 400; ++k) keys.push_back(k);
  Lookup(t, keys, true);
  for (int64_t k = 2; k <= 400; k += 2) CHECK(t.Erase(k));
  keys.push_back(0);
  rows.assign(keys.size(), nullptr);
  const auto before = t.Counters();
  {
    Reader(t).Find(keys.data(), static_cast<int64_t>(keys.size()), rows.data());
  }
  const auto after = t.Counters();
  CHECK(after.lookups - before.lookups == keys.size() && after.hits - before.hits == 200);
  bool ok = true;
  std::vector<float> v;
  int64_t f, ver;
  for (size_t i = 0; i < keys.size(); ++i) {
    const int64_t k = keys[i];
    if (k % 2 == 1) {
      ok &= t.Find(k, &v, &f, &ver) && std::equal(v.begin(), v.end(), rows[i]) &&
            rows[i] != t.DefaultRow(k);
    } else {
      ok &= rows[i] == t.DefaultRow(k);
    }
  }
  CHECK(ok);
}

void TestBadConstruction() {
  int threw = 0;
  try {
    Table<int64_t> t(0, Defaults(), 4);
  } catch (const std::invalid_argument&) {
    ++threw;
  }
  try {
    Table<int64_t> t(kDim, {1.0f, 2.0f}, 4);
  } catch (const std::invalid_argument&) {
    ++threw;
  }
  try {
    Table<int64_t> t(kDim, Defaults(), 0);
  } catch (const std::invalid_argument&) {
    ++threw;
  }
  CHECK(threw == 3);
}

// --- Change tracking: incremental export and replay ------------------------

template <typename K>
struct Snapshot {
  std::map<K, std::vector<float>> rows;  // value then slots
  std::map<K, std::pair<int64_t, int64_t>> meta, filtered;
  bool operator==(const Snapshot& o) const {
    return rows == o.rows && meta == o.meta && filtered == o.filtered;
  }
};

template <typename K>
Snapshot<K> Snap(const Exported<K>& x, int64_t dim, int64_t width) {
  Snapshot<K> s;
  for (size_t i = 0; i < x.keys.size(); ++i) {
    std::vector<float> r(x.values.begin() + i * dim, x.values.begin() + (i + 1) * dim);
    r.insert(r.end(), x.slots.begin() + i * width, x.slots.begin() + (i + 1) * width);
    s.rows[x.keys[i]] = r;
    s.meta[x.keys[i]] = {x.freqs[i], x.versions[i]};
  }
  for (size_t i = 0; i < x.keys_f.size(); ++i) {
    s.filtered[x.keys_f[i]] = {x.freqs_f[i], x.versions_f[i]};
  }
  return s;
}

template <typename K>
Exported<K> ExportSince(const Table<K>& t, int64_t since, std::vector<K>* erased, bool* complete) {
  Exported<K> x;
  *complete = t.ExportChangedSince(since, ExportInto(t, &x), erased);
  return x;
}

template <typename K>
void ImportInto(Table<K>& t, const Exported<K>& x, const std::vector<int>& ids,
                const std::vector<int64_t>& widths) {
  t.Import(x.keys.data(), x.values.data(), x.freqs.data(), x.versions.data(),
           static_cast<int64_t>(x.keys.size()), x.slots.data(), ids, widths);
  t.ImportFiltered(x.keys_f.data(), x.freqs_f.data(), x.versions_f.data(),
                   static_cast<int64_t>(x.keys_f.size()));
}

template <typename K>
void Train(Table<K>& t, const std::vector<K>& keys, int64_t step, int slot) {
  Lookup(t, keys, true);
  auto p = Partition(t, keys.data(), keys.size(), 1, Serial);
  std::vector<float> g(keys.size() * kDim);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i % 13) + 0.1f;
  for (int s = 0; s < t.num_shards(); ++s) {
    t.Apply(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s],
            p.order.data() + p.offsets[s], p.offsets[s + 1] - p.offsets[s], g.data(), {slot}, step,
            [](float* v, float** slots, const float* grad) {
              for (int64_t d = 0; d < kDim; ++d) {
                slots[0][d] += grad[d] * grad[d];
                v[d] -= 0.1f * grad[d];
              }
            });
  }
}

// A full export plus a chain of deltas replayed (erase logged keys, then
// import changed rows and counted keys) equals the table row for row,
// through training, counter-filter admission, eviction and re-insertion.
void CheckIncrementalChain(kre::kv::TableOptions o) {
  Table<int64_t> t(o);
  const int m = t.AddSlot("acc", kDim, 0.1f);
  std::vector<int64_t> base;
  for (int64_t k = 0; k < 200; ++k) base.push_back(k);
  Train(t, base, 1, m);
  Train(t, base, 2, m);  // admitted under a filter of 2 (trained from step 2)
  int64_t mark = t.MarkChanges();
  const Exported<int64_t> full = ExportAll(t);
  Table<int64_t> r(o);
  const int rm = r.AddSlot("acc", kDim, 0.1f);
  ImportInto(r, full, {rm}, {kDim});
  CHECK(Snap(ExportAll(r), kDim, kDim) == Snap(full, kDim, kDim));
  size_t total_changed = 0;
  for (int64_t step = 3; step <= 8; ++step) {
    std::vector<int64_t> batch;
    for (int64_t k = 0; k < 20; ++k) batch.push_back((step * 37 + k * 11) % 260);  // some new
    batch.push_back(1000 + step);  // seen once: counted, not admitted (with a filter)
    Train(t, batch, step, m);
    if (step == 5) CHECK(t.Evict(-1, 2, -1.0f) > 0);  // stale keys erased
    if (step == 6) {
      CHECK(t.Erase(batch[0]));
      Train(t, std::vector<int64_t>{batch[0], batch[0]}, step,
            m);  // erased, then back (re-inserted)
    }
    std::vector<int64_t> erased;
    bool complete = false;
    const int64_t next = t.MarkChanges();
    const Exported<int64_t> delta = ExportSince(t, mark, &erased, &complete);
    CHECK(complete);
    total_changed += delta.keys.size() + delta.keys_f.size();
    if (step == 5 || step == 6) CHECK(!erased.empty());
    for (int64_t k : erased) r.Erase(k);
    ImportInto(r, delta, {rm}, {kDim});
    t.TrimErasedLog(next);
    CHECK(t.ErasedLogSize() == 0);
    mark = next;
    CHECK(Snap(ExportAll(r), kDim, kDim) == Snap(ExportAll(t), kDim, kDim));
  }
  // Deltas hold far fewer rows than the table has.
  CHECK(total_changed < 6 * 60);
  // Nothing changed since the last mark: an empty delta.
  std::vector<int64_t> erased;
  bool complete = false;
  const Exported<int64_t> none = ExportSince(t, mark, &erased, &complete);
  CHECK(complete && none.keys.empty() && none.keys_f.empty() && erased.empty());
  // Inference lookups change nothing; counters count them.
  const kre::kv::TableCounters before = t.Counters();
  Lookup(t, std::vector<int64_t>{36, 47, 99999}, false);  // trained at step 8; never seen
  const Exported<int64_t> still = ExportSince(t, mark, &erased, &complete);
  CHECK(still.keys.empty() && still.keys_f.empty());
  const kre::kv::TableCounters after = t.Counters();
  CHECK(after.lookups == before.lookups + 3);
  uint64_t admitted_now = 0;
  for (int64_t k : {36, 47, 99999}) {
    std::vector<float> v;
    int64_t f, ver;
    if (t.Find(k, &v, &f, &ver) && !v.empty()) ++admitted_now;
  }
  CHECK(after.hits == before.hits + admitted_now);
  CHECK(after.erased == before.erased && after.admitted == before.admitted);
  // A clear replaces the contents: no delta spans it.
  t.Clear();
  ExportSince(t, mark, &erased, &complete);
  CHECK(!complete);
  const int64_t fresh = t.MarkChanges();
  ExportSince(t, fresh, &erased, &complete);
  CHECK(complete);
}

void TestIncrementalExport() {
  CheckIncrementalChain(FilterOptions(2));
  kre::kv::TableOptions plain = FilterOptions(0);
  CheckIncrementalChain(plain);
  kre::kv::TableOptions no_meta = FilterOptions(0);
  no_meta.track_meta = false;  // epochs per value row instead of in the metadata
  // (no versions: eviction by step erases nothing, Erase still does)
  Table<int64_t> t(no_meta);
  const int m = t.AddSlot("acc", kDim, 0.0f);
  Train(t, std::vector<int64_t>{1, 2, 3}, 1, m);
  const int64_t mark = t.MarkChanges();
  Train(t, std::vector<int64_t>{2, 4}, 2, m);
  CHECK(t.Erase(3));
  std::vector<int64_t> erased;
  bool complete = false;
  const Exported<int64_t> d = ExportSince(t, mark, &erased, &complete);
  std::vector<int64_t> keys = d.keys;
  std::sort(keys.begin(), keys.end());
  CHECK(complete && keys == (std::vector<int64_t>{2, 4}) && erased == std::vector<int64_t>{3});
  const kre::kv::TableCounters c = t.Counters();
  CHECK(c.admitted == 4 && c.erased == 1 && c.lookups == 5 && c.hits == 1);
}

// The index's load bound (ShardIndex::Reserve with kMaxLoad or
// kCompactMaxLoad): after each insertion the capacity is the smallest power
// of two (at least kMinCapacity) that the live keys fill to at most num /
// den, every key is found, and erasing does not grow the index (a tombstone
// rehash reuses the capacity).
void TestIndexMaxLoad() {
  using Index = kre::kv::ShardIndex<int64_t>;
  using Table64 = kre::kv::Table<int64_t>;
  auto key_of = [](uint64_t n) { return static_cast<int64_t>(n) * 7919; };
  for (const Index::MaxLoad limit : {Index::kMaxLoad, Index::kCompactMaxLoad}) {
    Index index;
    auto insert = [&](int64_t key) {
      index.Reserve(limit);
      index.Insert(key, Table64::Hash(key), Index::Entry{key, 0, 0});
    };
    bool minimal = true, bounded = true, reach = true;
    int reach_ones = 0, reach_threes = 0;
    for (uint64_t n = 1; n <= 20000; ++n) {
      insert(key_of(n));
      const uint64_t cap = index.capacity();
      bounded = bounded && n * limit.den <= cap * limit.num;
      minimal = minimal && (cap == Index::kMinCapacity || n * limit.den > cap / 2 * limit.num);
      // PrefetchProbe's second slot: h+1 up to load 0.4, h+3 above.
      reach = reach && index.reach() == (n * 5 <= cap * 2 ? 1u : 3u);
      (index.reach() == 1 ? reach_ones : reach_threes) += 1;
    }
    CHECK(bounded);
    CHECK(minimal);
    CHECK(reach);
    CHECK(reach_ones > 1000 && reach_threes > 1000);
    bool found = true;
    for (uint64_t n = 1; n <= 20000; ++n) {
      found = found && index.Find(key_of(n), Table64::Hash(key_of(n))) >= 0;
    }
    CHECK(found);
    CHECK(index.Find(3, Table64::Hash(3)) < 0);
    // Erase all but 100 keys, then insert 10000 new ones (fewer than half
    // of what the capacity allows): tombstones are rehashed away in place,
    // the capacity stays.
    const uint64_t cap = index.capacity();
    for (uint64_t n = 101; n <= 20000; ++n) {
      index.EraseAt(static_cast<uint64_t>(index.Find(key_of(n), Table64::Hash(key_of(n)))));
    }
    // Tombstones count as load.
    uint64_t in_use = 0;
    for (uint64_t i = 0; i < index.capacity(); ++i)
      in_use += index.entry(i).row != Index::kEmptySlot;
    CHECK(index.live() == 100 && in_use > 100);
    CHECK(index.reach() == (in_use * 5 <= index.capacity() * 2 ? 1u : 3u));
    for (uint64_t n = 1; n <= 10000; ++n) insert(-static_cast<int64_t>(n));
    CHECK(index.capacity() == cap);
    CHECK(index.live() == 10100);
  }
  CHECK(Index::kMaxLoad.num * Index::kCompactMaxLoad.den <
        Index::kCompactMaxLoad.num * Index::kMaxLoad.den);  // DRAM tables run sparser
}

}  // namespace

int main() {
  TestInsertFindDefaultRows<int64_t>();
  TestInsertFindDefaultRows<int32_t>();
  TestGrowManyKeys();
  TestIndexMaxLoad();
  TestEraseReusesRows();
  TestSlotsApplyDedupe();
  TestExportImportRoundTrip();
  TestPartitionStable();
  TestConcurrentReadersWriters();
  TestArenaRowsAcrossChunkSizes();
  TestCounterFilter();
  TestBloomFilter();
  TestBloomMemoryFollowsWrites();
  TestBloomStatePages();
  TestFreqCap();
  TestEviction();
  TestSaturatingMetadata();
  TestLookupCounted();
  TestLookupOrdered();
  TestLookupOrderedStreamed();
  TestOrderedReaderEdges();
  TestAnyShardCount();
  TestBadConstruction();
  TestIncrementalExport();
  return kre::kv::test::Report("table_test");
}
