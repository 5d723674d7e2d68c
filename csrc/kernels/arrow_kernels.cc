// Copyright keras_rec_emb authors. Apache-2.0.
// Kernel of KRE>ArrowBatchToTensors (csrc/ops/arrow_ops.cc): the columns of
// one Arrow record batch, received through the Arrow C data interface, as
// tensors that share the Arrow buffers where alignment allows. This lets
// ParquetDataset cross from Python to TensorFlow with one small tensor per
// batch instead of one NumPy array per component.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

// The Arrow C data interface (ABI-stable; definitions as the specification
// asks consumers to copy them).
#ifndef ARROW_C_DATA_INTERFACE
#define ARROW_C_DATA_INTERFACE
struct ArrowSchema {
  const char* format;
  const char* name;
  const char* metadata;
  int64_t flags;
  int64_t n_children;
  struct ArrowSchema** children;
  struct ArrowSchema* dictionary;
  void (*release)(struct ArrowSchema*);
  void* private_data;
};

struct ArrowArray {
  int64_t length;
  int64_t null_count;
  int64_t offset;
  int64_t n_buffers;
  int64_t n_children;
  const void** buffers;
  struct ArrowArray** children;
  struct ArrowArray* dictionary;
  void (*release)(struct ArrowArray*);
  void* private_data;
};
#endif  // ARROW_C_DATA_INTERFACE

// Addresses of the Arrow C structs that keras_rec_emb exported itself, as
// (ArrowArray, ArrowSchema) pairs. The package registers each export
// through kre_arrow_register (a plain C function it calls with ctypes, not
// reachable from a graph), and the kernel dereferences only addresses
// registered and not consumed yet: an arbitrary integer in a hand-built or
// crafted graph gets an error, not a wild pointer dereference.
namespace kre {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::map<int64_t, int64_t>& Registry() {
  static auto* live = new std::map<int64_t, int64_t>();
  return *live;
}

// Removes and returns whether (array, schema) was registered.
bool TakeRegistered(int64_t array, int64_t schema) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(array);
  if (it == Registry().end() || it->second != schema) return false;
  Registry().erase(it);
  return true;
}

}  // namespace
}  // namespace kre

extern "C" {
// Registers one export; returns 0 (1 when either address is null).
__attribute__((visibility("default"))) int kre_arrow_register(int64_t array, int64_t schema) {
  if (array == 0 || schema == 0) return 1;
  std::lock_guard<std::mutex> lock(kre::RegistryMutex());
  kre::Registry()[array] = schema;
  return 0;
}

// Forgets an export that was not consumed (its memory is about to be
// reused); returns 1 if it was registered.
__attribute__((visibility("default"))) int kre_arrow_unregister(int64_t array) {
  std::lock_guard<std::mutex> lock(kre::RegistryMutex());
  return kre::Registry().erase(array) > 0 ? 1 : 0;
}
}

namespace kre {
namespace {

namespace tf = ::tensorflow;
namespace errors = tf::errors;
using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;

// Owns a moved-in ArrowArray; releases it when the last tensor sharing its
// buffers goes away.
struct ArrayHolder {
  ArrowArray array{};
  ~ArrayHolder() {
    if (array.release != nullptr) array.release(&array);
  }
};

struct SchemaHolder {
  ArrowSchema schema{};
  ~SchemaHolder() {
    if (schema.release != nullptr) schema.release(&schema);
  }
};

class ArrowTensorBuffer : public tf::TensorBuffer {
 public:
  ArrowTensorBuffer(std::shared_ptr<ArrayHolder> holder, const void* data, size_t size)
      : TensorBuffer(const_cast<void*>(data)), holder_(std::move(holder)), size_(size) {}
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tf::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(size_));
    proto->set_allocator_name("arrow");
  }
  bool OwnsMemory() const override { return false; }

 private:
  std::shared_ptr<ArrayHolder> holder_;
  size_t size_;
};

struct LeafType {
  tf::DataType dtype;
  int bytes;  // per value; 0: bit-packed bool; -1/-2: string, 32/64-bit offsets
};

bool LeafOf(const std::string& f, LeafType* out) {
  static const struct {
    const char* format;
    LeafType type;
  } kLeaves[] = {
      {"c", {tf::DT_INT8, 1}},    {"C", {tf::DT_UINT8, 1}},   {"s", {tf::DT_INT16, 2}},
      {"S", {tf::DT_UINT16, 2}},  {"i", {tf::DT_INT32, 4}},   {"I", {tf::DT_UINT32, 4}},
      {"l", {tf::DT_INT64, 8}},   {"L", {tf::DT_UINT64, 8}},  {"e", {tf::DT_HALF, 2}},
      {"f", {tf::DT_FLOAT, 4}},   {"g", {tf::DT_DOUBLE, 8}},  {"b", {tf::DT_BOOL, 0}},
      {"u", {tf::DT_STRING, -1}}, {"z", {tf::DT_STRING, -1}}, {"U", {tf::DT_STRING, -2}},
      {"Z", {tf::DT_STRING, -2}},
  };
  for (const auto& l : kLeaves) {
    if (f == l.format) {
      *out = l.type;
      return true;
    }
  }
  return false;
}

bool BitSet(const void* bits, int64_t i) {
  return (static_cast<const uint8_t*>(bits)[i >> 3] >> (i & 7)) & 1;
}

// Nulls among logical entries [begin, end) of `a`.
bool HasNulls(const ArrowArray* a, int64_t begin, int64_t end) {
  if (a->null_count == 0 || a->n_buffers < 1 || a->buffers[0] == nullptr) return false;
  for (int64_t i = begin; i < end; ++i) {
    if (!BitSet(a->buffers[0], a->offset + i)) return true;
  }
  return false;
}

int64_t OffsetAt(const ArrowArray* a, bool large, int64_t i) {
  return large ? static_cast<const int64_t*>(a->buffers[1])[a->offset + i]
               : static_cast<const int32_t*>(a->buffers[1])[a->offset + i];
}

class ArrowBatchToTensorsOp : public OpKernel {
 public:
  explicit ArrowBatchToTensorsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("out_types", &out_types_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ragged_ranks", &ragged_ranks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("inner_ranks", &inner_ranks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("inner_shapes", &inner_shapes_));
    OP_REQUIRES(ctx, ragged_ranks_.size() == inner_ranks_.size(),
                errors::InvalidArgument("ragged_ranks and inner_ranks must have one entry "
                                        "per column, got ",
                                        ragged_ranks_.size(), " and ", inner_ranks_.size()));
    size_t dims = 0, components = 0;
    for (size_t c = 0; c < ragged_ranks_.size(); ++c) {
      OP_REQUIRES(ctx, ragged_ranks_[c] >= 0 && inner_ranks_[c] >= 0,
                  errors::InvalidArgument("column ", c,
                                          ": ragged and inner ranks must be "
                                          ">= 0"));
      dims += inner_ranks_[c];
      components += 1 + ragged_ranks_[c];
    }
    OP_REQUIRES(ctx, dims == inner_shapes_.size(),
                errors::InvalidArgument("inner_shapes has ", inner_shapes_.size(),
                                        " sizes, inner_ranks add up to ", dims));
    OP_REQUIRES(ctx, components == out_types_.size(),
                errors::InvalidArgument("out_types has ", out_types_.size(), " entries for ",
                                        components, " components"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& batch = ctx->input(0);
    OP_REQUIRES(ctx, batch.NumElements() == 2,
                errors::InvalidArgument("batch must hold 2 addresses (ArrowArray, "
                                        "ArrowSchema), got shape ",
                                        batch.shape().DebugString()));
    const int64_t array_address = batch.flat<int64_t>()(0);
    const int64_t schema_address = batch.flat<int64_t>()(1);
    OP_REQUIRES(
        ctx, TakeRegistered(array_address, schema_address),
        errors::InvalidArgument("batch [", array_address, ", ", schema_address,
                                "] is not an Arrow batch that keras_rec_emb exported (or it was "
                                "consumed already); KRE>ArrowBatchToTensors is private to "
                                "ParquetDataset"));
    auto* src_array = reinterpret_cast<ArrowArray*>(array_address);
    auto* src_schema = reinterpret_cast<ArrowSchema*>(schema_address);
    OP_REQUIRES(ctx, src_array->release != nullptr && src_schema->release != nullptr,
                errors::InvalidArgument("the Arrow batch was already released or consumed"));
    // Take ownership (moving a C-interface struct is a copy that marks the
    // source released).
    auto holder = std::make_shared<ArrayHolder>();
    holder->array = *src_array;
    src_array->release = nullptr;
    SchemaHolder schema;
    schema.schema = *src_schema;
    src_schema->release = nullptr;

    const ArrowArray& root = holder->array;
    const ArrowSchema& rs = schema.schema;
    const int64_t num_columns = static_cast<int64_t>(ragged_ranks_.size());
    OP_REQUIRES(ctx,
                std::string(rs.format) == "+s" && rs.n_children == num_columns &&
                    root.n_children == num_columns,
                errors::InvalidArgument("expected a struct batch of ", num_columns,
                                        " columns, got format '", rs.format, "' with ",
                                        rs.n_children, " children"));
    int out = 0;
    size_t dim0 = 0;
    for (int64_t c = 0; c < num_columns; ++c) {
      OP_REQUIRES_OK(ctx, Column(ctx, holder, root.children[c], rs.children[c], static_cast<int>(c),
                                 root.offset, root.offset + root.length, &dim0, &out));
    }
  }

 private:
  absl::Status Column(OpKernelContext* ctx, const std::shared_ptr<ArrayHolder>& holder,
                      const ArrowArray* a, const ArrowSchema* s, int c, int64_t begin, int64_t end,
                      size_t* dim0, int* out) {
    const std::string name = s->name ? s->name : "";
    const int ragged = static_cast<int>(ragged_ranks_[c]);
    const int inner = static_cast<int>(inner_ranks_[c]);
    const int64_t* shape = inner_shapes_.data() + *dim0;
    *dim0 += inner;
    std::vector<Tensor> splits;
    for (int level = 0; level < ragged + inner; ++level) {
      const std::string f = s->format;
      if (HasNulls(a, begin, end)) {
        return errors::InvalidArgument("column '", name, "': nulls at list level ", level,
                                       " (they must be filled before the batch is handed "
                                       "over)");
      }
      const int64_t rows = end - begin;
      int64_t child_begin, child_end;
      if (f == "+l" || f == "+L") {
        const bool large = f == "+L";
        child_begin = OffsetAt(a, large, begin);
        child_end = OffsetAt(a, large, end);
        if (level < ragged) {
          Tensor t;
          TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_INT64, TensorShape({rows + 1}), &t));
          int64_t* o = t.flat<int64_t>().data();
          for (int64_t i = 0; i <= rows; ++i) o[i] = OffsetAt(a, large, begin + i) - child_begin;
          splits.push_back(std::move(t));
        } else {
          const int64_t size = shape[level - ragged];
          for (int64_t i = begin; i < end; ++i) {
            const int64_t len = OffsetAt(a, large, i + 1) - OffsetAt(a, large, i);
            if (len != size) {
              return errors::InvalidArgument("column '", name, "' is read with a fixed size ", size,
                                             " at list level ", level, ", but a list there has ",
                                             len, " values");
            }
          }
        }
      } else if (f.rfind("+w:", 0) == 0) {
        const int64_t n = std::atoll(f.c_str() + 3);
        child_begin = (a->offset + begin) * n;
        child_end = (a->offset + end) * n;
        if (level < ragged) {
          Tensor t;
          TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_INT64, TensorShape({rows + 1}), &t));
          int64_t* o = t.flat<int64_t>().data();
          for (int64_t i = 0; i <= rows; ++i) o[i] = i * n;
          splits.push_back(std::move(t));
        } else if (n != shape[level - ragged]) {
          return errors::InvalidArgument("column '", name, "' is read with a fixed size ",
                                         shape[level - ragged], " at list level ", level,
                                         ", but its lists there have size ", n);
        }
      } else {
        return errors::InvalidArgument("column '", name, "' has Arrow format '", f, "' at level ",
                                       level, " where a list was expected (", ragged + inner,
                                       " list levels)");
      }
      if (a->n_children != 1 || s->n_children != 1) {
        return errors::InvalidArgument("column '", name, "': a list without one child");
      }
      a = a->children[0];
      s = s->children[0];
      begin = child_begin;
      end = child_end;
    }
    LeafType leaf;
    if (!LeafOf(s->format, &leaf)) {
      return errors::InvalidArgument("column '", name, "' has unsupported Arrow leaf format '",
                                     s->format, "'");
    }
    if (HasNulls(a, begin, end)) {
      return errors::InvalidArgument("column '", name,
                                     "': null values (they must be filled "
                                     "before the batch is handed over)");
    }
    if (*out >= static_cast<int>(out_types_.size()) || out_types_[*out] != leaf.dtype) {
      return errors::InvalidArgument("column '", name, "' has values of type ",
                                     tf::DataTypeString(leaf.dtype), " but the op expects ",
                                     *out < static_cast<int>(out_types_.size())
                                         ? tf::DataTypeString(out_types_[*out])
                                         : std::string("fewer components"));
    }
    const int64_t n = end - begin;
    int64_t inner_size = 1;
    for (int i = 0; i < inner; ++i) inner_size *= shape[i];
    TensorShape values_shape({inner_size == 0 ? 0 : n / inner_size});
    for (int i = 0; i < inner; ++i) values_shape.AddDim(shape[i]);
    Tensor values;
    if (leaf.bytes > 0) {
      const char* data = static_cast<const char*>(a->buffers[1]) + (a->offset + begin) * leaf.bytes;
      auto* buf = new ArrowTensorBuffer(holder, data, static_cast<size_t>(n * leaf.bytes));
      values = Tensor(leaf.dtype, values_shape, buf);
      buf->Unref();
      if (!values.IsAligned() || n == 0) {  // copy into TF memory
        Tensor copy;
        TF_RETURN_IF_ERROR(ctx->allocate_temp(leaf.dtype, values_shape, &copy));
        if (n > 0) std::memcpy(copy.data(), data, static_cast<size_t>(n * leaf.bytes));
        values = std::move(copy);
      }
    } else if (leaf.bytes == 0) {  // bit-packed bools
      TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_BOOL, values_shape, &values));
      bool* v = values.flat<bool>().data();
      for (int64_t i = 0; i < n; ++i) v[i] = BitSet(a->buffers[1], a->offset + begin + i);
    } else {
      TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_STRING, values_shape, &values));
      auto v = values.flat<tf::tstring>();
      const bool large = leaf.bytes == -2;
      const char* data = static_cast<const char*>(a->buffers[2]);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t o0 = OffsetAt(a, large, begin + i);
        const int64_t o1 = OffsetAt(a, large, begin + i + 1);
        v(i).assign(data + o0, static_cast<size_t>(o1 - o0));
      }
    }
    ctx->set_output((*out)++, values);
    for (Tensor& t : splits) {
      if (out_types_[*out] != tf::DT_INT64) {
        return errors::InvalidArgument("column '", name, "': row_splits component ", *out,
                                       " must be int64, the op expects ",
                                       tf::DataTypeString(out_types_[*out]));
      }
      ctx->set_output((*out)++, t);
    }
    return absl::OkStatus();
  }

  tf::DataTypeVector out_types_;
  std::vector<int64_t> ragged_ranks_;
  std::vector<int64_t> inner_ranks_;
  std::vector<int64_t> inner_shapes_;
};

REGISTER_KERNEL_BUILDER(Name("KRE>ArrowBatchToTensors").Device(tf::DEVICE_CPU),
                        ArrowBatchToTensorsOp);

}  // namespace
}  // namespace kre
