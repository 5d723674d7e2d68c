// benchmarks/kv_ab/run.sh: compiled twice, -DBENCH_NS=oldb -Dkv=kv_old (old csrc) and -DBENCH_NS=newb (this tree).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <memory>
#include <random>
#include <vector>
#include "kv/partition.h"
#include "kv/table.h"
namespace BENCH_NS {
using namespace kre::kv;
struct Serial { template <typename F> void operator()(int n, F&& f) const { for (int i = 0; i < n; ++i) f(i); } };
static double now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
static std::vector<int64_t> Zipf(std::mt19937_64& rng, int64_t n, int64_t size, double a) {
  std::vector<double> cdf(n); double s = 0;
  for (int64_t i = 0; i < n; ++i) { s += 1.0 / std::pow(double(i + 1), a); cdf[i] = s; }
  std::uniform_real_distribution<double> u(0, s);
  std::vector<int64_t> out(size);
  for (auto& o : out) o = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
  return out;
}
const int64_t dim = 16;
static std::vector<float> Defaults() { std::vector<float> v(97 * dim); for (size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * float(i); return v; }
template <typename T> void LookupAll(T& t, const Partitioned<int64_t>& p, bool insert, float* out) {
  for (int s = 0; s < t.num_shards(); ++s) t.Lookup(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s], p.order.data() + p.offsets[s], p.offsets[s+1]-p.offsets[s], insert, out);
}
struct Big {
  std::unique_ptr<Table<int64_t>> t; std::vector<int64_t> batch; std::vector<float> out;
};
struct Group {
  std::vector<std::unique_ptr<Table<int64_t>>> ts; std::vector<Partitioned<int64_t>> ps;
  std::vector<std::vector<int32_t>> counts; std::vector<float> out; std::vector<int32_t> skips;
};
// 26 EmbeddingVariable-sized tables (Zipf(1.1) ids over 10^6 values until
// ~15.5k distinct keys), each looked up with its own batch of 4096 Zipf ids
// (Partition + Lookup, as TableLookupOp does).
struct Ev {
  std::vector<std::unique_ptr<Table<int64_t>>> ts; std::vector<std::vector<int64_t>> batches; std::vector<float> out;
};
static Big* big; static Group* grp; static Ev* ev;
void Setup() {
  std::mt19937_64 rng(1);
  big = new Big;
  const int64_t N = 2000000, B = 500000;
  big->t.reset(new Table<int64_t>(dim, Defaults(), 32));
  std::vector<int64_t> keys(N);
  for (auto& k : keys) k = int64_t(rng() >> 1);
  { auto p = Partition(*big->t, keys.data(), N, 1, Serial()); std::vector<float> out(N * dim); LookupAll(*big->t, p, true, out.data()); }
  std::vector<int64_t> ranks = Zipf(rng, N, B, 1.1);
  std::vector<int64_t> perm(N); for (int64_t i = 0; i < N; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  big->batch.resize(B); for (int64_t i = 0; i < B; ++i) big->batch[i] = keys[perm[ranks[i]]];
  big->out.resize(B * dim);
  grp = new Group;
  const int T = 26; const int64_t N2 = 15500, U = 2341;
  for (int t = 0; t < T; ++t) {
    grp->ts.emplace_back(new Table<int64_t>(dim, Defaults(), 32));
    std::vector<int64_t> k2(N2); for (auto& k : k2) k = int64_t(rng() % 1000000);
    std::sort(k2.begin(), k2.end()); k2.erase(std::unique(k2.begin(), k2.end()), k2.end());
    auto p = Partition(*grp->ts[t], k2.data(), k2.size(), 1, Serial()); std::vector<float> out(k2.size() * dim);
    LookupAll(*grp->ts[t], p, true, out.data());
    std::shuffle(k2.begin(), k2.end(), rng);
    grp->ps.push_back(Partition(*grp->ts[t], k2.data(), U, 1, Serial()));
    grp->counts.emplace_back(U, 2);
  }
  grp->out.resize(U * dim); grp->skips.resize(U);
  ev = new Ev;
  std::vector<int64_t> id_perm(1000000); for (int64_t i = 0; i < 1000000; ++i) id_perm[i] = i;
  for (int t = 0; t < T; ++t) {
    std::shuffle(id_perm.begin(), id_perm.end(), rng);
    std::vector<int64_t> seen = Zipf(rng, 1000000, 40000, 1.1);
    for (auto& k : seen) k = id_perm[k];
    std::sort(seen.begin(), seen.end()); seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    ev->ts.emplace_back(new Table<int64_t>(dim, Defaults(), 32));
    auto p = Partition(*ev->ts[t], seen.data(), seen.size(), 1, Serial()); std::vector<float> out(seen.size() * dim);
    LookupAll(*ev->ts[t], p, true, out.data());
    std::vector<int64_t> b = Zipf(rng, 1000000, 4096, 1.1);
    for (auto& k : b) k = id_perm[k];
    ev->batches.push_back(b);
  }
  ev->out.resize(T * 4096 * dim);
}
// What TableLookupOp does: LookupOrdered where the table has it, else
// Partition + Lookup.
#ifndef KV_AB_PARTITIONED  // (-DKV_AB_PARTITIONED: Partition + Lookup always)
template <typename T>
auto EvLookup(T& t, const std::vector<int64_t>& b, bool insert, float* out, int)
    -> decltype(t.LookupOrdered(b.data(), 0, insert, out, 0), void()) {
  t.LookupOrdered(b.data(), b.size(), insert, out, dim);
}
#endif
template <typename T>
void EvLookup(T& t, const std::vector<int64_t>& b, bool insert, float* out, long) {
  auto p = Partition(t, b.data(), b.size(), 1, Serial());
  LookupAll(t, p, insert, out);
}
// ns per id of 26 table lookups.
double EvRound(bool insert) {
  double t0 = now(); int64_t n = 0;
  for (size_t t = 0; t < ev->ts.size(); ++t) {
    const auto& b = ev->batches[t]; n += b.size();
    EvLookup(*ev->ts[t], b, insert, ev->out.data() + t * 4096 * dim, 0);
  }
  return (now() - t0) / n * 1e9;
}
// The big batch as TableLookupOp runs it (LookupOrdered where present).
double BigKernelRound(bool insert) {
  double t0 = now();
  EvLookup(*big->t, big->batch, insert, big->out.data(), 0);  // (the kernel partitions a table this big)
  return (now() - t0) / big->batch.size() * 1e9;
}
int64_t EvKeys() { int64_t n = 0; for (auto& t : ev->ts) n += t->Size(); return n / int64_t(ev->ts.size()); }
// ns per id: partition+lookup, lookup only
void BigRound(bool insert, double* total, double* lookup) {
  const int64_t B = big->batch.size();
  double t0 = now();
  auto p = Partition(*big->t, big->batch.data(), B, 1, Serial());
  double t1 = now();
  LookupAll(*big->t, p, insert, big->out.data());
  double t2 = now();
  *total = (t2 - t0) / B * 1e9; *lookup = (t2 - t1) / B * 1e9;
}
double GroupRound(bool insert) {
  double t0 = now(); int64_t n = 0;
  for (size_t t = 0; t < grp->ts.size(); ++t) { auto& p = grp->ps[t]; n += p.keys.size();
    for (int s = 0; s < 32; ++s) grp->ts[t]->LookupCounted(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s], p.order.data() + p.offsets[s], grp->counts[t].data(), p.offsets[s+1]-p.offsets[s], insert, grp->out.data(), grp->skips.data()); }
  return (now() - t0) / n * 1e9;
}
float Checksum() { double s = 0; int64_t i = 0; for (float f : big->out) s += f * double(++i % 1013); for (float f : grp->out) s += f * double(++i % 1013); for (float f : ev->out) s += f * double(++i % 1013); return s; }
}
