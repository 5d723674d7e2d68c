#!/bin/bash
# A/B of the TF-free table's lookup (csrc/kv) in ONE process: the sources of
# git ref REF against the working tree's, interleaved
# rounds, thread CPU time (robust to a loaded machine), ratio old/new.
#   benchmarks/kv_ab/run.sh 07c71fd [REPS]
# OLD_FLAGS=-DKV_AB_PARTITIONED: the old side always partitions (ev case).
# Cases: a 2M-key table, batch 500k Zipf(1.1) ids (Lookup, insert false/true,
# and with Partition); 26 tables of ~15.5k keys, 2341 distinct keys each
# (LookupCounted, as the GroupLookup forward calls it). Checksums of both
# sides' outputs must be equal.
set -e
REF=${1:?usage: run.sh GIT_REF [REPS]}; REPS=${2:-9}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); HERE="$ROOT/benchmarks/kv_ab"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/old" && git -C "$ROOT" archive "$REF" csrc | tar -x -C "$TMP/old"
F="-O3 -march=x86-64-v2 -std=c++17 -pthread"
cd "$TMP"
g++ $F $OLD_FLAGS -DBENCH_NS=oldb -Dkv=kv_old -Iold/csrc -c "$HERE/impl.cc" -o o_impl.o
for f in old/csrc/kv/*.cc; do g++ $F -Dkv=kv_old -Iold/csrc -c "$f" -o "o_$(basename "$f" .cc).o"; done
g++ $F -DBENCH_NS=newb -I"$ROOT/csrc" -c "$HERE/impl.cc" -o n_impl.o
for f in "$ROOT"/csrc/kv/*.cc; do g++ $F -I"$ROOT/csrc" -c "$f" -o "n_$(basename "$f" .cc).o"; done
g++ $F "$HERE/main.cc" o_*.o n_*.o -o kv_ab
./kv_ab "$REPS"
