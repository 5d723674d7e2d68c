// Copyright keras_rec_emb authors. Apache-2.0.
// What the kv unit tests share: the CHECK macro and its failure count, a
// serial block runner for Partition, and exports of a table into vectors.
// Each *_test.cc is its own program (see the Makefile), so this header is
// included once per program.
#ifndef KRE_KV_TESTS_TEST_UTIL_H_
#define KRE_KV_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <optional>
#include <vector>

#include "kv/partition.h"
#include "kv/table.h"

// Failed CHECKs; main() reports them and exits non-zero.
inline int g_failures = 0;
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

namespace kre {
namespace kv {
namespace test {

// The end of a test program's main(): says how many CHECKs failed (exit
// status 1) or that all passed (0).
inline int Report(const char* program) {
  if (g_failures) {
    std::fprintf(stderr, "%s: %d CHECKs failed\n", program, g_failures);
    return 1;
  }
  std::printf("%s: all passed\n", program);
  return 0;
}

// Runs Partition's blocks one after another on the calling thread.
inline constexpr auto Serial = [](int blocks, auto&& fn) {
  for (int b = 0; b < blocks; ++b) fn(b);
};

// Looks `keys` up shard by shard, as the lookup kernel does, and returns
// their rows [n, dim] (-1 where a key is absent and not inserted); with
// `inserted`, also the number of keys the lookup inserted.
template <typename K>
std::vector<float> Lookup(Table<K>& t, const std::vector<K>& keys, bool insert,
                          int64_t* inserted = nullptr) {
  auto p = Partition(t, keys.data(), static_cast<int64_t>(keys.size()), 3, Serial);
  std::vector<float> out(keys.size() * t.dim(), -1.0f);
  int64_t total = 0;
  for (int s = 0; s < t.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    total += t.Lookup(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b,
                      p.offsets[s + 1] - b, insert, out.data());
  }
  if (inserted) *inserted = total;
  return out;
}

// A table's export (Table::ExportBuffers) held in vectors: admitted keys
// with values [n, dim], slots [n, total slot width], freqs and versions;
// the keys counted but not admitted with theirs.
template <typename K>
struct Exported {
  std::vector<K> keys, keys_f;
  std::vector<float> values, slots;
  std::vector<int64_t> freqs, versions, freqs_f, versions_f;
  bool operator==(const Exported& o) const {
    return keys == o.keys && keys_f == o.keys_f && freqs == o.freqs && versions == o.versions &&
           freqs_f == o.freqs_f && versions_f == o.versions_f && values == o.values &&
           slots == o.slots;
  }
};

// The `alloc` argument of Table::Export / ExportChangedSince that sizes *x
// and hands out its buffers. The slot width is read inside, under the
// table's shard locks, so it matches the rows exported.
template <typename K>
auto ExportInto(const Table<K>& t, Exported<K>* x) {
  return [&t, x](int64_t n, int64_t nf) {
    int64_t width = 0;
    for (const auto& spec : t.Slots()) width += spec.width;
    x->keys.resize(n);
    x->values.resize(n * t.dim());
    x->freqs.resize(n);
    x->versions.resize(n);
    x->slots.resize(n * width);
    x->keys_f.resize(nf);
    x->freqs_f.resize(nf);
    x->versions_f.resize(nf);
    return std::optional<typename Table<K>::ExportBuffers>(typename Table<K>::ExportBuffers{
        x->keys.data(), x->values.data(), x->freqs.data(), x->versions.data(), x->slots.data(),
        x->keys_f.data(), x->freqs_f.data(), x->versions_f.data()});
  };
}

// Every key, in the table's order.
template <typename K>
Exported<K> ExportAll(const Table<K>& t) {
  Exported<K> x;
  t.Export(ExportInto(t, &x));
  return x;
}

}  // namespace test
}  // namespace kv
}  // namespace kre

// The names every test program uses unqualified.
using kre::kv::Partition;
using kre::kv::Table;
using kre::kv::TableOptions;
using kre::kv::test::ExportAll;
using kre::kv::test::ExportInto;
using kre::kv::test::Lookup;
using kre::kv::test::Serial;

#endif  // KRE_KV_TESTS_TEST_UTIL_H_
