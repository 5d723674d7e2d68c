#!/bin/bash
# A/B of a training step's table work (csrc/kv) in ONE process: the sources
# of git ref REF against the working tree's, interleaved steps, thread CPU
# time (robust to a loaded machine), medians in ns per distinct id of the
# lookups, the applies and both, and old/new. Both sides' tables must end
# equal (checksums).
#   benchmarks/kv_ab/step.sh 230f186 [STEPS]
set -e
REF=${1:?usage: step.sh GIT_REF [STEPS]}; STEPS=${2:-300}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); HERE="$ROOT/benchmarks/kv_ab"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/old" && git -C "$ROOT" archive "$REF" csrc | tar -x -C "$TMP/old"
F="-O3 -march=x86-64-v2 -std=c++17 -pthread"
cd "$TMP"
g++ $F -DBENCH_NS=oldb -Dkv=kv_old -Iold/csrc -c "$HERE/step_impl.cc" -o o_impl.o
for f in old/csrc/kv/*.cc; do g++ $F -Dkv=kv_old -Iold/csrc -c "$f" -o "o_$(basename "$f" .cc).o"; done
g++ $F -DBENCH_NS=newb -I"$ROOT/csrc" -c "$HERE/step_impl.cc" -o n_impl.o
for f in "$ROOT"/csrc/kv/*.cc; do g++ $F -I"$ROOT/csrc" -c "$f" -o "n_$(basename "$f" .cc).o"; done
g++ $F "$HERE/step_main.cc" o_*.o n_*.o -o step_ab
./step_ab "$STEPS"
