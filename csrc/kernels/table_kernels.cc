// Copyright keras_rec_emb authors. Apache-2.0.
// Kernels that create, read and (de)serialize embedding tables.
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/table_resource.h"
#include "kernels/validate.h"
#include "kv/shard_ops.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"

namespace kre {
namespace {

class TableCreateOp : public OpKernel {
 public:
  explicit TableCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key_dtype", &key_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &options_.dim));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &options_.num_shards));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("track_meta", &options_.track_meta));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("filter_freq", &options_.filter_freq));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bloom_hashes", &options_.bloom_hashes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bloom_counter_bytes", &options_.bloom_counter_bytes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("no_permission_value", &options_.no_permission_value));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("storage_path", &options_.storage_path));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_shared_name", &shared_name_));
    // The integer attributes with a lower bound.
    int64_t bloom_counters, cache_bytes;
    for (auto [name, min, value] : {std::tuple{"bloom_counters", 0, &bloom_counters},
                                    {"cache_bytes", 1, &cache_bytes},
                                    {"freq_cap", 0, &options_.freq_cap}}) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr(name, value));
      OP_REQUIRES(ctx, *value >= min,
                  errors::InvalidArgument(name, " must be >= ", min, ", got ", *value));
    }
    options_.bloom_counters = static_cast<uint64_t>(bloom_counters);
    options_.cache_bytes = static_cast<uint64_t>(cache_bytes);
    const int shards = options_.num_shards;
    OP_REQUIRES(ctx, shards >= 1 && shards <= 65536,
                errors::InvalidArgument("num_shards must be in [1, 65536], got ", shards));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& defaults = ctx->input(0);
    OP_REQUIRES(
        ctx,
        defaults.dims() == 2 && defaults.dim_size(1) == options_.dim && defaults.dim_size(0) >= 1,
        errors::InvalidArgument("default_values must be [default_value_dim >= 1, ", options_.dim,
                                "], got ", defaults.shape().DebugString()));
    if (!shared_name_.empty()) {
      ComputeShared(ctx, defaults);
      return;
    }
    TableResourceBase* resource;
    OP_REQUIRES_OK(ctx, NewTable(defaults, &resource));
    Tensor* out;
    tf::AllocatorAttributes attr;
    attr.set_on_host(true);
    absl::Status s = ctx->allocate_output(0, TensorShape({}), &out, attr);
    if (!s.ok()) {
      resource->Unref();
      ctx->SetStatus(s);
      return;
    }
    // The handle owns the new resource's one reference.
    out->scalar<tf::ResourceHandle>()() =
        tf::ResourceHandle::MakeRefCountingHandle<TableResourceBase>(resource,
                                                                     ctx->device()->name());
  }

 private:
  absl::Status NewTable(const Tensor& defaults, TableResourceBase** resource) {
    auto flat = defaults.flat<float>();
    kv::TableOptions options = options_;
    options.default_values.assign(flat.data(), flat.data() + flat.size());
    try {
      if (key_dtype_ == tf::DT_INT64) {
        *resource = new TableResource<int64_t>(std::move(options));
      } else {
        *resource = new TableResource<int32_t>(std::move(options));
      }
    } catch (const std::bad_alloc&) {
      return errors::ResourceExhausted(
          "could not allocate the embedding table's counting Bloom filter of bloom_counters=",
          options_.bloom_counters, " counters of ", options_.bloom_counter_bytes,
          " bytes; lower CBFFilter's max_element_size or raise its "
          "false_positive_probability");
    } catch (const std::exception& e) {
      return errors::InvalidArgument(e.what());
    }
    return absl::OkStatus();
  }

  // A table named `table_shared_name` in the device's resource manager, found or
  // created; the handle refers to it by name (it lives until the server or
  // process ends), so every client of the device reaches the same table.
  void ComputeShared(OpKernelContext* ctx, const Tensor& defaults) {
    tf::ResourceMgr* rm = ctx->resource_manager();
    TableResourceBase* resource = nullptr;
    OP_REQUIRES_OK(ctx, rm->LookupOrCreate<TableResourceBase>(
                            rm->default_container(), shared_name_, &resource,
                            [&](TableResourceBase** r) { return NewTable(defaults, r); }));
    tf::core::ScopedUnref unref(resource);
    OP_REQUIRES(ctx, resource->key_dtype() == key_dtype_ && resource->dim() == options_.dim,
                errors::InvalidArgument(
                    "the shared embedding table '", shared_name_, "' exists with key dtype ",
                    tf::DataTypeString(resource->key_dtype()), " and dim ", resource->dim(),
                    " but was requested with key dtype ", tf::DataTypeString(key_dtype_),
                    " and dim ", options_.dim, "; give every worker the same table config"));
    Tensor* out;
    tf::AllocatorAttributes attr;
    attr.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out, attr));
    out->scalar<tf::ResourceHandle>()() =
        tf::MakeResourceHandle<TableResourceBase>(ctx, rm->default_container(), shared_name_);
  }

  tf::DataType key_dtype_;
  std::string shared_name_;
  kv::TableOptions options_;  // all but default_values
};

REGISTER_KERNEL_BUILDER(Name("KRE>TableCreate").Device(tf::DEVICE_CPU), TableCreateOp);

// Looks keys[0..n) up shard by shard over the pool, partitioned first;
// keys[i] stands for counts[i] occurrences, or one with counts == nullptr.
// Row i goes to out + i * dim.
template <typename K>
absl::Status LookupByShard(OpKernelContext* ctx, kv::Table<K>& table, const K* keys, int64_t n,
                           const int32_t* counts, bool insert, int64_t dim, float* out) {
  kv::Partitioned<K> p = PartitionKeys(ctx, table, keys, n);
  const int64_t per_shard = n / table.num_shards() + 1;
  return ParallelFor(ctx, table.num_shards(), per_shard * (40 + dim), [&](int64_t s) {
    const int64_t b = p.offsets[s];
    const int64_t m = p.offsets[s + 1] - b;
    const int shard = static_cast<int>(s);
    if (counts == nullptr) {
      table.Lookup(shard, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, m, insert,
                   out);
    } else {
      table.LookupCounted(shard, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, counts,
                          m, insert, out);
    }
  });
}

// KRE>TableLookup, and with kCounted KRE>TableLookupCounted.
template <typename K, bool kCounted = false>
class TableLookupOp : public TableOpKernel<K> {
 public:
  explicit TableLookupOp(OpKernelConstruction* ctx) : TableOpKernel<K>(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("insert", &insert_));
  }

  void ComputeOnTable(OpKernelContext* ctx, kv::Table<K>& table) override {
    if constexpr (kCounted) {
      LookupCounted(ctx, table);
    } else {
      Lookup(ctx, table);
    }
  }

 private:
  static constexpr int64_t kOrderedBlock = kv::Table<K>::kOrderedBlock;

  void Lookup(OpKernelContext* ctx, kv::Table<K>& table) {
    const int64_t dim = this->dim_;
    const Tensor& keys = ctx->input(1);
    TensorShape out_shape = keys.shape();
    OP_REQUIRES_OK(ctx, out_shape.AddDimWithStatus(dim));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    const int64_t n = keys.NumElements();
    if (n == 0) return;
    const K* k = keys.flat<K>().data();
    float* o = out->flat<float>().data();
    if (table.PrefersOrderedLookup(n)) {
      // In batch order, no partition: blocks of ids over the pool, each
      // block with every shard locked shared (kv::Table::LookupOrdered).
      const int64_t blocks = (n + kOrderedBlock - 1) / kOrderedBlock;
      OP_REQUIRES_OK(ctx, ParallelFor(ctx, blocks, kOrderedBlock * (40 + dim), [&](int64_t b) {
                       const int64_t begin = b * kOrderedBlock;
                       const int64_t end = std::min(n, begin + kOrderedBlock);
                       table.LookupOrdered(k + begin, end - begin, insert_, o + begin * dim, dim);
                     }));
      return;
    }
    OP_REQUIRES_OK(ctx, LookupByShard(ctx, table, k, n, nullptr, insert_, dim, o));
  }

  void LookupCounted(OpKernelContext* ctx, kv::Table<K>& table) {
    const int64_t dim = this->dim_;
    const Tensor& keys = ctx->input(1);
    const Tensor& counts = ctx->input(2);
    OP_REQUIRES(
        ctx, keys.dims() == 1 && keys.shape() == counts.shape(),
        errors::InvalidArgument("keys and counts must be vectors of one length, got ",
                                keys.shape().DebugString(), " and ", counts.shape().DebugString()));
    const int64_t n = keys.NumElements();
    const int32_t* c = counts.flat<int32_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, c[i] >= 1,
                  errors::InvalidArgument("counts[", i, "] is ", c[i],
                                          ": each key stands for at least one occurrence"));
    }
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    if (n == 0) return;
    float* o = out->flat<float>().data();
    // Several askers may send one key: it is looked up once with their
    // counts summed, as one process counts the whole batch (an admission
    // filter then admits it or not for all of them alike).
    const K* k = keys.flat<K>().data();
    kv::BatchGroups groups(n);
    std::vector<K> uniq;
    std::vector<int32_t> total;
    std::vector<int64_t> group_of(n);
    uniq.reserve(n);
    total.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      bool created;
      const int64_t g = groups.Group(
          kv::Table<K>::Hash(k[i]), [&](int64_t j) { return uniq[j] == k[i]; }, &created);
      if (created) {
        uniq.push_back(k[i]);
        total.push_back(0);
      }
      total[g] = static_cast<int32_t>(
          std::min<int64_t>(int64_t{total[g]} + c[i], std::numeric_limits<int32_t>::max()));
      group_of[i] = g;
    }
    const int64_t u = static_cast<int64_t>(uniq.size());
    Tensor distinct_rows;
    float* rows = o;
    if (u < n) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT, TensorShape({u, dim}), &distinct_rows));
      rows = distinct_rows.flat<float>().data();
    }
    OP_REQUIRES_OK(ctx,
                   LookupByShard(ctx, table, uniq.data(), u, total.data(), insert_, dim, rows));
    if (u < n) {
      for (int64_t i = 0; i < n; ++i) {
        std::copy_n(rows + group_of[i] * dim, dim, o + i * dim);
      }
    }
  }

  bool insert_;
};

template <typename K>
using TableLookupCountedOp = TableLookupOp<K, /*kCounted=*/true>;

template <typename K>
void TableSize(OpKernelContext* ctx, kv::Table<K>& table) {
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 0, table.Size()));
}

// The snapshot ops: on a file-tier table, runs `call` (a snapshot or a
// restore, which throws on failure) and outputs its result as scalar 0; an
// exception becomes a status of `code`, "<what> failed: <reason>".
template <typename K, typename Call>
void FileTierCall(OpKernelContext* ctx, const kv::Table<K>& t, absl::StatusCode code,
                  const char* what, Call&& call) {
  OP_REQUIRES(ctx, t.file_tier(),
              errors::InvalidArgument(
                  "snapshots need a file-tier table (StorageOption(\"FILE\", storage_path=...))"));
  int64_t result = 0;
  try {
    result = call();
  } catch (const std::exception& e) {
    ctx->SetStatus(absl::Status(code, absl::StrCat(what, " failed: ", e.what())));
    return;
  }
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 0, result));
}

template <typename K>
void TableSnapshot(OpKernelContext* ctx, kv::Table<K>& t) {
  FileTierCall(ctx, t, absl::StatusCode::kInternal, "snapshot", [&] { return t.Snapshot(); });
}

template <typename K>
void TableRestoreSnapshot(OpKernelContext* ctx, kv::Table<K>& t) {
  FileTierCall(ctx, t, absl::StatusCode::kInvalidArgument, "snapshot restore", [&] {
    return t.RestoreSnapshot(std::string(ctx->input(1).scalar<tf::tstring>()()));
  });
}

template <typename K>
void TableReleaseStorage(OpKernelContext* ctx, kv::Table<K>& t) {
  if (t.file_tier()) t.ReleaseStorageLock();
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 0, t.file_tier()));
}

template <typename K>
void TableEvict(OpKernelContext* ctx, kv::Table<K>& table) {
  int64_t step, steps_to_live;
  float l2;
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "step", &step));
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(2), "steps_to_live", &steps_to_live));
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(3), "l2_threshold", &l2));
  OP_REQUIRES(ctx, !std::isnan(l2), errors::InvalidArgument("`l2_threshold` must not be NaN"));
  OP_REQUIRES_OK(ctx, SetScalarOutput(ctx, 0, table.Evict(step, steps_to_live, l2)));
}

template <typename K>
void TableAddSlot(OpKernelContext* ctx, kv::Table<K>& table) {
  tf::tstring tname;
  int64_t width;
  float init;
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(1), "slot_name", &tname));
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(2), "width", &width));
  OP_REQUIRES_OK(ctx, validate::Scalar(ctx->input(3), "init", &init));
  const std::string name(tname);
  OP_REQUIRES(ctx, !name.empty(), errors::InvalidArgument("`slot_name` must not be empty"));
  OP_REQUIRES_OK(ctx, validate::SlotWidth(width, "width"));
  OP_REQUIRES_OK(ctx, validate::Finite(&init, 1, "init"));
  try {
    table.AddSlot(name, width, init);
  } catch (const std::bad_alloc&) {
    ctx->SetStatus(errors::ResourceExhausted("could not allocate optimizer slot '", name,
                                             "' of width ", width, "; the table is unchanged"));
  } catch (const std::exception& e) {
    ctx->SetStatus(errors::InvalidArgument(e.what()));
  }
}

// Exports every row (KRE>TableExport); without `include_filtered` the keys
// counted but not admitted are left out.
template <typename K>
void TableExport(OpKernelContext* ctx, kv::Table<K>& table, bool include_filtered) {
  absl::Status status;
  // Filtered keys left out are written to scratch space and not output.
  std::vector<K> skip_keys;
  std::vector<int64_t> skip_freqs, skip_versions;
  table.Export([&](int64_t n, int64_t nf) {
    auto b = AllocateExportOutputs(ctx, table, n, include_filtered ? nf : 0, &status);
    if (b && !include_filtered) {
      skip_keys.resize(nf);
      skip_freqs.resize(nf);
      skip_versions.resize(nf);
      b->keys_filtered = skip_keys.data();
      b->freqs_filtered = skip_freqs.data();
      b->versions_filtered = skip_versions.data();
    }
    return b;
  });
  OP_REQUIRES_OK(ctx, status);
  OP_REQUIRES_OK(ctx, SetBloomOutput(ctx, 11, table));
}

// Inserts or overwrites rows (KRE>TableImport), after clearing the table
// when `clear`.
template <typename K>
void TableImport(OpKernelContext* ctx, kv::Table<K>& table, bool clear) {
  const int64_t dim = table.dim();
  const Tensor &keys = ctx->input(1), &values = ctx->input(2), &freqs = ctx->input(3),
               &versions = ctx->input(4), &slots = ctx->input(5), &names = ctx->input(6),
               &widths = ctx->input(7), &defaults = ctx->input(8), &keys_f = ctx->input(9),
               &freqs_f = ctx->input(10), &versions_f = ctx->input(11), &bloom = ctx->input(12);
  // Every part is checked before the table is touched: a checkpoint or an
  // export is untrusted input, and a failed import leaves the table as it
  // was.
  int64_t n;
  OP_REQUIRES_OK(ctx, validate::KeysAndRows(keys, values, "values", dim, &n));
  OP_REQUIRES_OK(ctx, validate::Vector(freqs, "freqs", n));
  OP_REQUIRES_OK(ctx, validate::Vector(versions, "versions", n));
  OP_REQUIRES_OK(ctx, validate::UniqueNames(names, "slot_names"));
  int64_t total = 0;
  OP_REQUIRES_OK(ctx, validate::SlotWidths(widths, "slot_widths", &total));
  OP_REQUIRES(ctx, widths.NumElements() == names.NumElements(),
              errors::InvalidArgument("`slot_names` and `slot_widths` must have one length, "
                                      "got ",
                                      names.NumElements(), " and ", widths.NumElements()));
  OP_REQUIRES_OK(ctx, validate::Matrix(slots, "slot_values", n, total));
  OP_REQUIRES_OK(ctx, validate::Matrix(defaults, "default_values", -1, dim));
  OP_REQUIRES_OK(ctx, validate::Vector(keys_f, "keys_filtered"));
  const int64_t nf = keys_f.dim_size(0);
  OP_REQUIRES_OK(ctx, validate::Vector(freqs_f, "freqs_filtered", nf));
  OP_REQUIRES_OK(ctx, validate::Vector(versions_f, "versions_filtered", nf));
  OP_REQUIRES_OK(ctx, validate::Vector(bloom, "bloom"));
  const K* k = keys.flat<K>().data();
  const K* kf = keys_f.flat<K>().data();
  OP_REQUIRES_OK(ctx, validate::UniqueKeys(k, n, "keys"));
  OP_REQUIRES_OK(ctx, validate::UniqueKeys(kf, nf, "keys_filtered"));
  // A merge into a live table (clear=false, AdaptiveEmbedding's promotion)
  // may pass freq -1: "keep the count the table already has". A restore
  // (clear=true) takes only real counts.
  OP_REQUIRES_OK(
      ctx, validate::AtLeast<int64_t>(freqs.flat<int64_t>().data(), n, clear ? 0 : -1, "freqs"));
  OP_REQUIRES_OK(
      ctx, validate::AtLeast<int64_t>(freqs_f.flat<int64_t>().data(), nf, 0, "freqs_filtered"));
  OP_REQUIRES_OK(ctx, validate::Finite(values.flat<float>().data(), n * dim, "values", dim));
  OP_REQUIRES_OK(ctx,
                 validate::Finite(slots.flat<float>().data(), n * total, "slot_values", total));
  // default_values may hold infinities: AdaptiveEmbedding marks rows with them.
  const size_t bloom_bytes = table.BloomStateBytes();
  OP_REQUIRES(
      ctx, bloom.NumElements() == 0 || static_cast<size_t>(bloom.NumElements()) == bloom_bytes,
      errors::InvalidArgument("`bloom` has ", bloom.NumElements(),
                              " bytes but this table's counting Bloom filter has ", bloom_bytes,
                              "; it was saved with other CBFFilter "
                              "settings"));
  std::vector<std::string> slot_names(names.NumElements());
  std::vector<int64_t> w(widths.NumElements());
  for (int64_t j = 0; j < names.NumElements(); ++j) {
    slot_names[j] = std::string(names.flat<tf::tstring>()(j));
    w[j] = widths.flat<int64_t>()(j);
  }
  const std::vector<kv::SlotSpec> specs = table.Slots();
  for (size_t j = 0; j < slot_names.size(); ++j) {
    for (const auto& spec : specs) {
      OP_REQUIRES(ctx, spec.name != slot_names[j] || spec.width == w[j],
                  errors::InvalidArgument("slot '", spec.name, "' has width ", spec.width,
                                          " in the table but ", w[j], " in the data"));
    }
  }
  // Read from the input tensor, not copied: a filter may be tens of GiB.
  const uint8_t* bloom_state = bloom.flat<uint8_t>().data();
  const size_t bloom_size = static_cast<size_t>(bloom.NumElements());
  std::vector<float> new_defaults;
  if (defaults.dim_size(0) > 0) {
    auto d = defaults.flat<float>();
    new_defaults.assign(d.data(), d.data() + d.size());
  }
  auto fill = [&](kv::Table<K>& dst) {
    std::vector<int> ids;
    for (size_t j = 0; j < slot_names.size(); ++j) {
      const int id = dst.SlotIndex(slot_names[j]);
      ids.push_back(id >= 0 ? id : dst.AddSlot(slot_names[j], w[j], 0.0f));
    }
    if (!new_defaults.empty()) dst.SetDefaultValues(new_defaults);
    dst.Import(k, values.flat<float>().data(), freqs.flat<int64_t>().data(),
               versions.flat<int64_t>().data(), n, slots.flat<float>().data(), ids, w);
    dst.ImportFiltered(kf, freqs_f.flat<int64_t>().data(), versions_f.flat<int64_t>().data(), nf);
    if (bloom_size != 0 && !dst.SetBloomState(bloom_state, bloom_size)) {
      throw std::invalid_argument(
          "`bloom` is not a counting Bloom filter state of this table's CBFFilter "
          "settings");
    }
  };
  try {
    if (clear) {
      // A restore: build the new contents on the side, then swap them in,
      // so that a failure (e.g. out of memory) leaves the table exactly
      // as before. Peak memory is the old plus the new contents.
      kv::TableOptions options = table.options();
      options.default_values = table.DefaultValues();
      options.storage_lock = false;  // a file tier's staging table beside the live one
      kv::Table<K> staging(std::move(options));
      for (const auto& spec : specs) staging.AddSlot(spec.name, spec.width, spec.init);
      fill(staging);
      table.SwapContents(staging);  // the replaced rows (and files) go with staging
    } else {
      fill(table);
    }
  } catch (const std::bad_alloc&) {
    ctx->SetStatus(errors::ResourceExhausted("import of ", n, " rows (", dim, " values and ", total,
                                             " slot values each) ran out of memory",
                                             clear ? "; the table is unchanged" : ""));
  } catch (const std::exception& e) {
    ctx->SetStatus(errors::InvalidArgument("import failed: ", e.what()));
  }
}

KRE_REGISTER_TABLE_KERNEL("KRE>TableLookup", TableLookupOp);
KRE_REGISTER_TABLE_KERNEL("KRE>TableLookupCounted", TableLookupCountedOp);
KRE_REGISTER_TABLE_FN("KRE>TableSize", TableSize);
KRE_REGISTER_TABLE_FN("KRE>TableSnapshot", TableSnapshot);
KRE_REGISTER_TABLE_FN("KRE>TableReleaseStorage", TableReleaseStorage);
KRE_REGISTER_TABLE_FN("KRE>TableRestoreSnapshot", TableRestoreSnapshot);
KRE_REGISTER_TABLE_FN("KRE>TableEvict", TableEvict);
KRE_REGISTER_TABLE_FN("KRE>TableAddSlot", TableAddSlot);
// The attributes of the flag of TableExport and TableImport.
constexpr char kIncludeFiltered[] = "include_filtered";
constexpr char kClear[] = "clear";
KRE_REGISTER_TABLE_FLAG_FN("KRE>TableExport", TableExport, kIncludeFiltered);
KRE_REGISTER_TABLE_FLAG_FN("KRE>TableImport", TableImport, kClear);

}  // namespace
}  // namespace kre
