// A/B driver of benchmarks/kv_ab/run.sh: impl.cc compiled twice (old and new csrc/kv).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define DECL(NS) namespace NS { void Setup(); void BigRound(bool, double*, double*); double GroupRound(bool); double EvRound(bool); double BigKernelRound(bool); int64_t EvKeys(); float Checksum(); }
DECL(oldb) DECL(newb)
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 9;
  oldb::Setup(); newb::Setup();
  const char* names[] = {"big lookup insert=0", "big lookup insert=1", "big part+lookup insert=0", "group counted insert=0", "group counted insert=1", "ev 26x4096 part+lookup ins=0", "ev 26x4096 part+lookup ins=1", "big as kernel ins=0", "big as kernel ins=1"};
  std::vector<double> r[2][9];
  for (int i = 0; i < reps; ++i) {
    for (int v = 0; v < 2; ++v) {
      for (int ins = 0; ins < 2; ++ins) {
        double tot, lk;
        (v ? newb::BigRound : oldb::BigRound)(ins, &tot, &lk);
        r[v][ins].push_back(lk); if (!ins) r[v][2].push_back(tot);
        double g = 0; for (int k = 0; k < 4; ++k) g += (v ? newb::GroupRound : oldb::GroupRound)(ins);
        r[v][3 + ins].push_back(g / 4);
        double e = 0; for (int k = 0; k < 4; ++k) e += (v ? newb::EvRound : oldb::EvRound)(ins);
        r[v][5 + ins].push_back(e / 4);
        r[v][7 + ins].push_back((v ? newb::BigKernelRound : oldb::BigKernelRound)(ins));
      }
    }
  }
  printf("checksums %g %g; ev keys/table %lld\n", oldb::Checksum(), newb::Checksum(), (long long)newb::EvKeys());
  for (int k = 0; k < 9; ++k) printf("%-28s old %7.1f  new %7.1f ns/id  old/new %.2fx\n", names[k], med(r[0][k]), med(r[1][k]), med(r[0][k]) / med(r[1][k]));
}
