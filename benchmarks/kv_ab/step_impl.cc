// benchmarks/kv_ab/step.sh: compiled twice, -DBENCH_NS=oldb -Dkv=kv_old (old csrc) and
// -DBENCH_NS=newb (this tree). A training step's table work on 26 tables of ~15.5k keys (dim
// 16, 32 shards, an Adagrad slot), as the group lookup and its apply run it: LookupCounted
// (insert) of each table's distinct ids of a batch of 4096 Zipf(1.1) ids, then ApplyDistinct
// of the same ids, table after table (the other tables' work in between, as in a step).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <memory>
#include <random>
#include <set>
#include <vector>
#include "kv/partition.h"
#include "kv/table.h"
namespace BENCH_NS {
using namespace kre::kv;
struct Serial { template <typename F> void operator()(int n, F&& f) const { for (int i = 0; i < n; ++i) f(i); } };
static double now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
const int64_t dim = 16; const int T = 26; const int kBatches = 8;
struct G { std::vector<std::unique_ptr<Table<int64_t>>> ts; std::vector<std::vector<Partitioned<int64_t>>> ps; std::vector<int32_t> counts; std::vector<float> out, grads; int acc[T]; int step = 0; double sum = 0; };
static G* g;
void Setup() {
  std::mt19937_64 rng(1);
  g = new G;
  std::vector<double> cdf(1000000); double s = 0;
  for (size_t i = 0; i < cdf.size(); ++i) { s += 1.0 / std::pow(double(i + 1), 1.1); cdf[i] = s; }
  std::uniform_real_distribution<double> u(0, s);
  std::vector<float> defaults(97 * dim); for (size_t i = 0; i < defaults.size(); ++i) defaults[i] = 0.001f * float(i);
  for (int t = 0; t < T; ++t) {
    g->ts.emplace_back(new Table<int64_t>(dim, defaults, 32));
    g->acc[t] = g->ts[t]->AddSlot("accumulator", dim, 0.1f);
    std::vector<int64_t> perm(1000000); for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(i); std::shuffle(perm.begin(), perm.end(), rng);
    // Warm the table with ~15.5k keys, then kBatches batches of 4096 Zipf ids (distinct ids each).
    std::set<int64_t> seen;
    while (seen.size() < 15500) seen.insert(perm[std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin()]);
    std::vector<int64_t> k(seen.begin(), seen.end());
    auto p = Partition(*g->ts[t], k.data(), k.size(), 1, Serial()); std::vector<float> out(k.size() * dim);
    for (int sh = 0; sh < 32; ++sh) g->ts[t]->Lookup(sh, p.keys.data() + p.offsets[sh], p.hashes.data() + p.offsets[sh], p.order.data() + p.offsets[sh], p.offsets[sh+1]-p.offsets[sh], true, out.data());
    g->ps.emplace_back();
    for (int b = 0; b < kBatches; ++b) {
      std::vector<int64_t> ids; std::set<int64_t> d;
      for (int i = 0; i < 4096; ++i) { int64_t id = perm[std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin()]; if (d.insert(id).second) ids.push_back(id); }
      g->ps[t].push_back(Partition(*g->ts[t], ids.data(), ids.size(), 1, Serial()));
    }
  }
  g->counts.assign(4096, 1); g->out.resize(4096 * dim); g->grads.resize(4096 * dim);
  for (size_t i = 0; i < g->grads.size(); ++i) g->grads[i] = 1e-3f * float(i % 97);
}
// ns per distinct id of the lookups and of the applies of one step.
void Round(double* lookup, double* apply) {
  const int b = g->step++ % kBatches;
  int64_t n = 0; double t0 = now();
  for (int t = 0; t < T; ++t) { const auto& p = g->ps[t][b]; n += p.keys.size();
    for (int s = 0; s < 32; ++s) g->ts[t]->LookupCounted(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s], p.order.data() + p.offsets[s], g->counts.data(), p.offsets[s+1]-p.offsets[s], true, g->out.data());
    g->sum += g->out[7]; }
  double t1 = now();
  for (int t = 0; t < T; ++t) { const auto& p = g->ps[t][b];
    for (int s = 0; s < 32; ++s) g->ts[t]->ApplyDistinct(s, p.keys.data() + p.offsets[s], p.hashes.data() + p.offsets[s], p.order.data() + p.offsets[s], p.offsets[s+1]-p.offsets[s], g->grads.data(), {g->acc[t]}, g->step,
        [](float* v, float** slots, const float* gr) { for (int64_t d = 0; d < dim; ++d) { slots[0][d] += gr[d] * gr[d]; v[d] -= 0.05f * gr[d] / std::sqrt(slots[0][d]); } }); }
  double t2 = now();
  *lookup = (t1 - t0) / n * 1e9; *apply = (t2 - t1) / n * 1e9;
}
double Checksum() { double s = g->sum; for (auto& t : g->ts) { std::vector<float> v; int64_t f, ver; for (int64_t k = 0; k < 2000; ++k) if (t->Find(k, &v, &f, &ver) && !v.empty()) s += v[0] * double(k % 13); } return s; }
}
