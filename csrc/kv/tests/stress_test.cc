// Copyright keras_rec_emb authors. Apache-2.0.
// Failure atomicity and a concurrency stress test of the TF-free table. Run by
// `make test` plainly, under ASan+UBSan (test-kv-asan) and under
// ThreadSanitizer (test-kv-tsan).
//
// * Running out of memory in AddSlot or in a row insert leaves the table as
//   it was; SwapContents exchanges everything or nothing.
// * Stress: threads do lookups with insert, fused applies that update value
//   and slot rows, evictions and exports on one table at once. Afterwards
//   the table is consistent: exported keys are unique, their number equals
//   Size(), every key's row, metadata and slot agree with Find, and each
//   surviving key's slot counts exactly the applies that touched it since it
//   was (re)inserted (checked through an invariant kept inside its row).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kv/partition.h"
#include "kv/table.h"
#include "kv/tests/test_util.h"

using Exported = kre::kv::test::Exported<int64_t>;

namespace {

constexpr int64_t kDim = 8;

// One fused apply: every touched row gets value[d] -= 1 for all d (so all
// its values stay equal), its slot counts the applies.
void ApplyAll(Table<int64_t>& t, const std::vector<int64_t>& keys, int slot, int64_t step) {
  auto p = Partition(t, keys.data(), static_cast<int64_t>(keys.size()), 2, Serial);
  std::vector<float> grads(keys.size() * kDim, 0.0f);
  for (int s = 0; s < t.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    t.Apply(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, p.offsets[s + 1] - b,
            grads.data(), {slot}, step, [&](float* value, float** slots, const float*) {
              for (int64_t d = 0; d < kDim; ++d) value[d] -= 1.0f;
              slots[0][0] += 1.0f;
            });
  }
}

std::vector<float> Zeros() { return std::vector<float>(kDim, 0.0f); }

[[maybe_unused]] void TestAddSlotOutOfMemoryKeepsTable() {
  Table<int64_t> t(kDim, Zeros(), 4);
  Lookup(t, {1, 2, 3}, true);
  t.AddSlot("m", kDim, 0.5f);
  const Exported before = ExportAll(t);
  bool threw = false;
  try {
    t.AddSlot("huge", int64_t{1} << 40, 0.0f);  // 16 rows * 2^40 floats
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(t.Slots().size() == 1 && t.SlotIndex("huge") == -1);
  const Exported after = ExportAll(t);
  CHECK(after.keys == before.keys && after.values == before.values && after.slots == before.slots);
  // New keys, applies and exports still work.
  Lookup(t, {10, 11}, true);
  ApplyAll(t, {10, 1}, 0, 5);
  CHECK(t.Size() == 5 && ExportAll(t).slots.size() == 5 * kDim);
}

void TestSwapContents() {
  Table<int64_t> a(kDim, Zeros(), 4), b(kDim, std::vector<float>(2 * kDim, 1.0f), 4);
  Lookup(a, {1, 2}, true);
  a.AddSlot("m", kDim, 0.0f);
  b.AddSlot("m", kDim, 0.0f);
  b.AddSlot("v", 1, 0.0f);
  Lookup(b, {7, 8, 9}, true);
  a.SwapContents(b);
  CHECK(a.Size() == 3 && b.Size() == 2 && a.Slots().size() == 2 && b.Slots().size() == 1);
  CHECK(a.default_value_dim() == 2);
  // A target with a slot the other lacks refuses and changes nothing.
  Table<int64_t> c(kDim, Zeros(), 4);
  bool threw = false;
  try {
    a.SwapContents(c);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw && a.Size() == 3 && a.Slots().size() == 2);
  // Different shard counts refuse too.
  Table<int64_t> d(kDim, Zeros(), 8);
  threw = false;
  try {
    d.SwapContents(a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw && a.Size() == 3);
}

void TestConcurrentStress() {
  TableOptions o;
  o.dim = kDim;
  o.default_values = Zeros();
  o.num_shards = 8;
  Table<int64_t> t(o);
  const int slot = t.AddSlot("count", 1, 0.0f);
  constexpr int64_t kKeys = 4000;
  constexpr int kRounds = 150;
  std::atomic<int> export_problems{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  // Inserting lookups.
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(w + 1);
      for (int r = 0; r < kRounds; ++r) {
        std::vector<int64_t> keys(64);
        for (auto& k : keys) k = static_cast<int64_t>(rng() % kKeys);
        Lookup(t, keys, true);
      }
    });
  }
  // Fused applies.
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(100 + w);
      for (int r = 0; r < kRounds; ++r) {
        std::vector<int64_t> keys(64);
        for (auto& k : keys) k = static_cast<int64_t>(rng() % kKeys);
        ApplyAll(t, keys, slot, r);
      }
    });
  }
  // Eviction: rows not applied in the last 20 steps, and rows of L2 norm
  // below 0.5 (new rows, all zeros, not applied yet); an evicted key comes
  // back fresh on its next insert.
  threads.emplace_back([&] {
    while (!done.load()) {
      t.Evict(-1, /*steps_to_live=*/20, /*l2_threshold=*/0.5f);
      std::this_thread::yield();
    }
  });
  // Exports: consistent snapshots (every key once; rows obey the invariant).
  threads.emplace_back([&] {
    while (!done.load()) {
      const Exported x = ExportAll(t);
      std::set<int64_t> unique(x.keys.begin(), x.keys.end());
      if (unique.size() != x.keys.size()) ++export_problems;
      for (size_t i = 0; i < x.keys.size(); ++i) {
        for (int64_t d = 1; d < kDim; ++d) {
          if (x.values[i * kDim + d] != x.values[i * kDim]) ++export_problems;
        }
        // value = -(applies since inserted) = -count.
        if (x.values[i * kDim] != -x.slots[i]) ++export_problems;
      }
    }
  });
  for (size_t i = 0; i < 4; ++i) threads[i].join();
  done.store(true);
  for (size_t i = 4; i < threads.size(); ++i) threads[i].join();
  CHECK(export_problems.load() == 0);
  const Exported x = ExportAll(t);
  std::set<int64_t> unique(x.keys.begin(), x.keys.end());
  CHECK(unique.size() == x.keys.size());
  CHECK(static_cast<int64_t>(x.keys.size()) == t.Size());
  std::vector<float> v;
  int64_t f, ver;
  for (size_t i = 0; i < x.keys.size(); ++i) {
    CHECK(x.keys[i] >= 0 && x.keys[i] < kKeys);
    CHECK(t.Find(x.keys[i], &v, &f, &ver));
    CHECK(v.size() == static_cast<size_t>(kDim) && v[0] == x.values[i * kDim]);
    CHECK(f == x.freqs[i] && ver == x.versions[i]);
    CHECK(x.values[i * kDim] == -x.slots[i]);
  }
}

// Table::LookupOrdered from several threads on one table (2 shards, so the
// threads meet on each): trainers count frequencies under the shared lock
// (keys present) and insert new keys under the exclusive one, readers read
// rows (one through OrderedReader's pointers), an exporter reads
// frequencies meanwhile. Every row read is the key's initializer row
// (nothing is applied), and the final frequencies are exactly the trainers'
// occurrences.
void TestConcurrentOrderedLookups() {
  TableOptions o;
  o.dim = kDim;
  o.default_values.resize(5 * kDim);
  for (size_t i = 0; i < o.default_values.size(); ++i) o.default_values[i] = float(i / kDim);
  o.num_shards = 2;
  Table<int64_t> t(o);
  constexpr int64_t kKeys = 3000;
  constexpr int kRounds = 60;
  constexpr int64_t kBatch = 256;
  {
    std::vector<int64_t> first(kKeys / 2);  // half the keys exist before
    for (int64_t i = 0; i < kKeys / 2; ++i) first[i] = 2 * i;
    std::vector<float> out(first.size() * kDim);
    t.LookupOrdered(first.data(), static_cast<int64_t>(first.size()), true, out.data(), kDim);
  }
  auto batch = [](int w, int r) {
    std::mt19937_64 rng(1000 * w + r);
    std::vector<int64_t> keys(kBatch);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % (rng() % 2 ? 40 : kKeys));  // hot keys
    return keys;
  };
  std::atomic<int> problems{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      const bool insert = w < 2;
      std::vector<float> out(kBatch * kDim);
      for (int r = 0; r < kRounds; ++r) {
        const std::vector<int64_t> keys = batch(w, r);
        if (w == 3) {  // rows read in place, through pointers, under a reader
          std::vector<const float*> rows(kBatch);
          Table<int64_t>::OrderedReader reader(t);
          reader.Find(keys.data(), kBatch, rows.data());
          for (int64_t i = 0; i < kBatch; ++i) {
            for (int64_t d = 0; d < kDim; ++d) {
              if (rows[i][d] != float(keys[i] % 5)) ++problems;
            }
          }
          continue;
        }
        t.LookupOrdered(keys.data(), kBatch, insert, out.data(), kDim);
        for (int64_t i = 0; i < kBatch; ++i) {
          if (out[i * kDim] != float(keys[i] % 5)) ++problems;
        }
      }
    });
  }
  std::thread exporter([&] {
    while (!done.load()) {
      const Exported x = ExportAll(t);
      for (int64_t f : x.freqs) {
        if (f < 1) ++problems;
      }
    }
  });
  for (auto& th : threads) th.join();
  done.store(true);
  exporter.join();
  CHECK(problems.load() == 0);
  std::map<int64_t, int64_t> want;
  for (int64_t i = 0; i < kKeys / 2; ++i) want[2 * i] = 1;
  for (int w = 0; w < 2; ++w) {
    for (int r = 0; r < kRounds; ++r) {
      for (int64_t k : batch(w, r)) ++want[k];
    }
  }
  CHECK(t.Size() == static_cast<int64_t>(want.size()));
  std::vector<float> v;
  int64_t f, ver;
  bool exact = true;
  for (const auto& kv : want) exact &= t.Find(kv.first, &v, &f, &ver) && f == kv.second;
  CHECK(exact);
  const auto c = t.Counters();
  CHECK(c.lookups == static_cast<uint64_t>(kKeys / 2 + 4 * kRounds * kBatch));
}

}  // namespace

int main() {
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // The sanitizers' operator new reports a failed allocation and aborts
  // instead of throwing std::bad_alloc, so this runs in the plain build.
  TestAddSlotOutOfMemoryKeepsTable();
#endif
  TestSwapContents();
  TestConcurrentStress();
  TestConcurrentOrderedLookups();
  return kre::kv::test::Report("stress_test");
}
