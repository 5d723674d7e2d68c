// Copyright keras_rec_emb authors. Apache-2.0.
// Op registrations and shape functions of the embedding table. Kernels live
// in csrc/kernels/.
#include <initializer_list>

#include "ops/stat_parts.h"
#include "ops/table_shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kre {
namespace {

// Inputs first, first + 1, ... have the ranks `ranks`; their shapes go to
// shapes[0], shapes[1], ...
absl::Status InputRanks(InferenceContext* c, int first, std::initializer_list<int> ranks,
                        ShapeHandle* shapes) {
  for (int rank : ranks) TF_RETURN_IF_ERROR(c->WithRank(c->input(first++), rank, shapes++));
  return absl::OkStatus();
}

// Merges dimension 0 of `shapes` into *rows.
absl::Status MergeRows(InferenceContext* c, std::initializer_list<ShapeHandle> shapes,
                       DimensionHandle* rows) {
  *rows = c->Dim(*shapes.begin(), 0);
  for (ShapeHandle s : shapes) TF_RETURN_IF_ERROR(c->Merge(*rows, c->Dim(s, 0), rows));
  return absl::OkStatus();
}

// Input i is the EV-initializer matrix default_values [default_value_dim, dim].
absl::Status DefaultValuesInput(InferenceContext* c, int i, int64_t dim) {
  ShapeHandle defaults;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &defaults));
  DimensionHandle unused;
  return c->WithValue(c->Dim(defaults, 1), dim, &unused);
}

// The shape function of KRE>TableLookup (keys of any shape, values
// [keys.shape..., dim]) and, `counted`, of KRE>TableLookupCounted (keys [n]
// and counts [n], values [n, dim]).
template <bool counted>
absl::Status LookupShape(InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(HandleAndDim(c, &dim));
  ShapeHandle keys = c->input(1);
  if constexpr (counted) {
    ShapeHandle counts;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
    TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &counts));
    TF_RETURN_IF_ERROR(c->Merge(keys, counts, &keys));
  }
  ShapeHandle values;
  TF_RETURN_IF_ERROR(c->Concatenate(keys, c->Vector(dim), &values));
  c->set_output(0, values);
  return absl::OkStatus();
}

}  // namespace

// Creates an anonymous embedding table from integer keys to float rows of width
// `dim` and returns a ref-counting handle: the table lives as long as a handle
// to it does. `default_values` [default_value_dim, dim] are the EV-initializer
// rows: a new key k starts as row k mod default_value_dim. `filter_freq` > 1
// turns on the counter admission filter, or with `bloom_counters` > 0 the
// counting Bloom filter; keys not admitted read `no_permission_value`.
// `freq_cap` > 0 stops each key's frequency at that count.
// A non-empty `table_shared_name` instead finds or creates the table of that
// name in the device's resource manager and returns a handle by name: every
// client of a TensorFlow server (parameter-server training: several workers)
// that asks for the same name on the same device gets the same table, which
// lives as long as the server. The first creator's options win; a later
// request with another key dtype or dim is an error.
// The attr is deliberately NOT called `shared_name`: loading a SavedModel
// (function_deserialization.fix_node_def) rewrites every op's `shared_name`,
// an empty one included, to "<node name>_load_<uid>", which would turn every
// table of a loaded model (all their TableCreate nodes have the same node
// name) into one shared table.
REGISTER_OP("KRE>TableCreate")
    .Input("default_values: float")
    .Output("handle: resource")
    .Attr("key_dtype: {int32, int64}")
    .Attr("dim: int >= 1")
    .Attr("num_shards: int = 32")
    .Attr("track_meta: bool = true")
    .Attr("filter_freq: int = 0")
    .Attr("bloom_counters: int = 0")
    .Attr("bloom_hashes: int = 0")
    .Attr("bloom_counter_bytes: int = 8")
    .Attr("no_permission_value: float = 0.0")
    .Attr("storage_path: string = ''")
    .Attr("cache_bytes: int = 67108864")
    .Attr("freq_cap: int = 0")
    .Attr("table_shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(GetDim(c, &dim));
      TF_RETURN_IF_ERROR(DefaultValuesInput(c, 0, dim));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

// Gathers the rows of `keys` (any shape) into values [keys.shape..., dim]. With
// `insert`, missing keys are inserted with their default row and every
// occurrence counts towards the key's frequency (training); without, missing
// keys read their default row and the table is unchanged (inference).
KRE_REGISTER_TABLE_OP("KRE>TableLookup")
    .Input("keys: Tkeys")
    .Output("values: float")
    .Attr("dim: int >= 1")
    .Attr("insert: bool = false")
    .SetShapeFn(LookupShape</*counted=*/false>);

// TableLookup of `keys` [n] where keys[i] stands for counts[i] >= 1
// occurrences of it in a batch (the MultiWorkerMirroredStrategy owner's
// lookup of the ids other workers asked for, each with how often it
// occurred there): the table ends as if every occurrence had been looked up
// with TableLookup, and values [n, dim] holds each key's row once.
KRE_REGISTER_TABLE_OP("KRE>TableLookupCounted")
    .Input("keys: Tkeys")
    .Input("counts: int32")
    .Output("values: float")
    .Attr("dim: int >= 1")
    .Attr("insert: bool = false")
    .SetShapeFn(LookupShape</*counted=*/true>);

KRE_REGISTER_TABLE_OP("KRE>TableSize").Output("size: int64").SetShapeFn(ScalarOfHandle<1>);

// The table's sizes: a vector of the parts kTableStatsParts names
// (ops/stat_parts.h; the caller passes the names it reads them by as
// `parts`, checked by the kernel).
KRE_REGISTER_TABLE_OP("KRE>TableStats")
    .Output("stats: int64")
    .Attr(PartsAttr(kTableStatsParts))
    .SetShapeFn(VectorOfHandle<kTableStatsParts.size()>);

// The row store's counters: a vector of the parts kStorageStatsParts names
// (checked as KRE>TableStats' are).
KRE_REGISTER_TABLE_OP("KRE>TableStorageStats")
    .Output("stats: int64")
    .Attr(PartsAttr(kStorageStatsParts))
    .SetShapeFn(VectorOfHandle<kStorageStatsParts.size()>);

// File tier: writes a snapshot under the table's storage_path; returns its
// sequence number.
KRE_REGISTER_TABLE_OP("KRE>TableSnapshot").Output("seq: int64").SetShapeFn(ScalarOfHandle<1>);

// File tier: releases the lock on the table's storage_path (its Python
// owner is gone); returns whether the table is a file-tier one.
KRE_REGISTER_TABLE_OP("KRE>TableReleaseStorage")
    .Output("released: bool")
    .SetShapeFn(ScalarOfHandle<1>);

// File tier: replaces the contents with the latest snapshot under `path`
// (the table's storage_path when empty); returns the number of keys.
KRE_REGISTER_TABLE_OP("KRE>TableRestoreSnapshot")
    .Input("path: string")
    .Output("keys: int64")
    .SetShapeFn(ScalarOfHandle<2>);

// Erases admitted keys not updated for more than `steps_to_live` steps
// before `step` (when steps_to_live >= 0; step < 0 means the table's latest
// step), admitted keys whose row L2 norm is below `l2_threshold` (when >= 0),
// and keys not admitted last seen more than `steps_to_live` steps ago.
// Returns how many.
KRE_REGISTER_TABLE_OP("KRE>TableEvict")
    .Input("step: int64")
    .Input("steps_to_live: int64")
    .Input("l2_threshold: float")
    .Output("evicted: int64")
    .SetShapeFn(ScalarOfHandle<4>);

// Adds an optimizer slot (per-row state of `width` floats, `init` for new rows)
// or, if it exists with that width, sets its init value for rows made from now.
KRE_REGISTER_TABLE_OP("KRE>TableAddSlot")
    .Input("slot_name: string")
    .Input("width: int64")
    .Input("init: float")
    .SetShapeFn([](InferenceContext* c) { return HandleAndScalars(c, 4); });

// Exports every row: keys [N], values [N, dim], freqs [N], versions [N], the
// optimizer slots side by side in slot_values [N, sum(slot_widths)], the
// EV-initializer matrix default_values [default_value_dim, dim], the keys
// counted but not admitted with their counts and versions (empty unless
// include_filtered), and the Bloom filter's counters as bytes.
KRE_REGISTER_TABLE_OP("KRE>TableExport")
    .KRE_TABLE_EXPORT_OUTPUTS.Attr("dim: int >= 1")
    .Attr("include_filtered: bool = true")
    .SetShapeFn(ExportOfHandle<1>);

// Inserts or overwrites rows (after clearing the table when `clear`). Slots
// named in slot_names that the table lacks are created with init 0. A
// non-empty default_values [default_value_dim, dim] replaces the
// EV-initializer matrix. Keys counted but not admitted come back with their
// counts (under a counter filter; otherwise they are dropped), and Bloom
// counters are restored when their size matches the table's filter.
KRE_REGISTER_TABLE_OP("KRE>TableImport")
    .Input("keys: Tkeys")
    .Input("values: float")
    .Input("freqs: int64")
    .Input("versions: int64")
    .Input("slot_values: float")
    .Input("slot_names: string")
    .Input("slot_widths: int64")
    .Input("default_values: float")
    .Input("keys_filtered: Tkeys")
    .Input("freqs_filtered: int64")
    .Input("versions_filtered: int64")
    .Input("bloom: uint8")
    .Attr("dim: int >= 1")
    .Attr("clear: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(HandleAndDim(c, &dim));
      // keys, values, freqs, versions, slot_values, slot_names, slot_widths;
      // default_values; keys, freqs and versions filtered, bloom.
      ShapeHandle in[7], filtered[4];
      TF_RETURN_IF_ERROR(InputRanks(c, 1, {1, 2, 1, 1, 2, 1, 1}, in));
      TF_RETURN_IF_ERROR(DefaultValuesInput(c, 8, dim));
      TF_RETURN_IF_ERROR(InputRanks(c, 9, {1, 1, 1, 1}, filtered));
      DimensionHandle n, nf, unused;
      TF_RETURN_IF_ERROR(MergeRows(c, {filtered[0], filtered[1], filtered[2]}, &nf));
      TF_RETURN_IF_ERROR(MergeRows(c, {in[0], in[1], in[2], in[3], in[4]}, &n));
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(in[1], 1), dim, &unused));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(in[5], 0), c->Dim(in[6], 0), &unused));
      return absl::OkStatus();
    });

// The inputs, attributes and shape function of a fused optimizer step on the
// rows of `keys` (KRE>TableSparseApply and KRE>TableSparseApplyDistinct).
#define KRE_REGISTER_SPARSE_APPLY_OP(name)                                      \
  KRE_REGISTER_TABLE_OP(name)                                                   \
      .Input("keys: Tkeys")                                                     \
      .Input("grads: float")                                                    \
      .Input("hyper: float")                                                    \
      .Input("step: int64")                                                     \
      .Attr(                                                                    \
          "rule: {'sgd', 'momentum', 'adagrad', 'adam', 'ftrl', 'adam_async', " \
          "'adagrad_decay', 'ftrl_group'}")                                     \
      .Attr("slots: list(string) >= 0")                                         \
      .Attr("hparam_names: list(string) >= 2")                                  \
      .SetShapeFn(SparseApplyShape)

absl::Status SparseApplyShape(InferenceContext* c) {
  TF_RETURN_IF_ERROR(ScalarHandle(c));
  ShapeHandle in[4];  // keys, grads, hyper, step
  TF_RETURN_IF_ERROR(InputRanks(c, 1, {1, 2, 1, 0}, in));
  DimensionHandle unused;
  return MergeRows(c, {in[0], in[1]}, &unused);
}

// One fused optimizer step on the rows of `keys`: equal keys are deduplicated
// and their gradient rows summed, each distinct row (value and slots) is updated
// in place by `rule` with hyper-parameters `hyper`, and its version is set to
// `step`. Missing keys are inserted first, unless an admission filter is on:
// then gradients of keys not admitted are dropped. `hparam_names` names the
// entries of `hyper` and `slots` the table slots the rule reads, as declared in
// keras_rec_emb/_update_rules.py; the kernel checks both against its own.
KRE_REGISTER_SPARSE_APPLY_OP("KRE>TableSparseApply");

// KRE>TableSparseApply for `keys` that are distinct (the caller promises it:
// the table gradient of KRE>GroupLookup, or the output of a unique): the same
// update, version stamps, insertions and filtering, without the dedupe and
// the copy of the gradient rows, with the rows prefetched ahead. Equal keys
// would be applied once each, in order, instead of once with their sum.
KRE_REGISTER_SPARSE_APPLY_OP("KRE>TableSparseApplyDistinct");

absl::Status GroupSparseApplyShape(InferenceContext* c) {
  int n;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  for (int t = 0; t < n; ++t) {
    ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(t), 0, &unused));
    ShapeHandle keys, grads, hyper;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(n + t), 1, &keys));
    TF_RETURN_IF_ERROR(c->WithRank(c->input(2 * n + t), 2, &grads));
    TF_RETURN_IF_ERROR(c->WithRank(c->input(3 * n + t), 1, &hyper));
    DimensionHandle rows;
    TF_RETURN_IF_ERROR(c->Merge(c->Dim(keys, 0), c->Dim(grads, 0), &rows));
  }
  ShapeHandle step;
  return c->WithRank(c->input(4 * n), 0, &step);
}

// KRE>TableSparseApplyDistinct of N tables with one key dtype, one rule and
// one set of slot names in one op: table t's distinct keys[t], grads[t]
// and hyper[t], at one step. The tables are updated concurrently over the
// intra-op pool, each as KRE>TableSparseApplyDistinct would update it.
REGISTER_OP("KRE>GroupSparseApplyDistinct")
    .Input("handles: N * resource")
    .Input("keys: N * Tkeys")
    .Input("grads: N * float")
    .Input("hyper: N * float")
    .Input("step: int64")
    .Attr("N: int >= 1")
    .Attr("Tkeys: {int32, int64}")
    .Attr(
        "rule: {'sgd', 'momentum', 'adagrad', 'adam', 'ftrl', 'adam_async', "
        "'adagrad_decay', 'ftrl_group'}")
    .Attr("slots: list(string) >= 0")
    .Attr("hparam_names: list(string) >= 2")
    .SetIsStateful()
    .SetShapeFn(GroupSparseApplyShape);

}  // namespace kre
