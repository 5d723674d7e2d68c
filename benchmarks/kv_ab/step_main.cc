// A/B driver of benchmarks/kv_ab/step.sh: step_impl.cc compiled twice (old and new csrc/kv).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define DECL(NS) namespace NS { void Setup(); void Round(double*, double*); double Checksum(); }
DECL(oldb) DECL(newb)
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 200;
  oldb::Setup(); newb::Setup();
  std::vector<double> l[2], a[2];
  for (int i = 0; i < reps; ++i) for (int v = 0; v < 2; ++v) { double x, y; (v ? newb::Round : oldb::Round)(&x, &y); if (i >= 8) { l[v].push_back(x); a[v].push_back(y); } }
  printf("checksums %.9g %.9g\n", oldb::Checksum(), newb::Checksum());
  printf("lookup ns/id old %.1f new %.1f old/new %.3f\n", med(l[0]), med(l[1]), med(l[0]) / med(l[1]));
  printf("apply  ns/id old %.1f new %.1f old/new %.3f\n", med(a[0]), med(a[1]), med(a[0]) / med(a[1]));
  std::vector<double> s0, s1; for (size_t i = 0; i < l[0].size(); ++i) { s0.push_back(l[0][i] + a[0][i]); s1.push_back(l[1][i] + a[1][i]); }
  printf("both   ns/id old %.1f new %.1f old/new %.3f\n", med(s0), med(s1), med(s0) / med(s1));
}
