// Copyright keras_rec_emb authors. Apache-2.0.
// The kernels' input contract, in one place: one helper per kind of input
// (scalar, vector, matrix, row splits, indices in range, unique names, finite
// floats, slot widths). Every kernel validates its inputs with these before
// it reads them, so a malformed input (a hand-built op call, a crafted
// checkpoint, a serving request) gets an InvalidArgument naming the input,
// the value and what is allowed, never a crash. Shape functions in csrc/ops
// reject what they can at graph-build time; these run on every call because
// eager execution skips shape functions.
#ifndef KRE_KERNELS_VALIDATE_H_
#define KRE_KERNELS_VALIDATE_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_set>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace kre {
namespace validate {

namespace tf = ::tensorflow;

// Widest optimizer slot row, in floats (a slot is `dim` or 1 float wide in
// practice; this bounds what a crafted checkpoint can make us allocate per
// row: 16384 rows of a chunk at this width are 64 GiB).
constexpr int64_t kMaxSlotWidth = int64_t{1} << 20;

// A scalar input of dtype T.
template <typename T>
absl::Status Scalar(const tf::Tensor& t, const char* name, T* out) {
  if (!tf::TensorShapeUtils::IsScalar(t.shape())) {
    return tf::errors::InvalidArgument("`", name, "` must be a scalar, got shape ",
                                       t.shape().DebugString());
  }
  if (t.dtype() != tf::DataTypeToEnum<T>::v()) {
    return tf::errors::InvalidArgument("`", name, "` must be ",
                                       tf::DataTypeString(tf::DataTypeToEnum<T>::v()), ", got ",
                                       tf::DataTypeString(t.dtype()));
  }
  *out = t.scalar<T>()();
  return absl::OkStatus();
}

// A 1-D input; of length n when n >= 0.
inline absl::Status Vector(const tf::Tensor& t, const char* name, int64_t n = -1) {
  if (t.dims() != 1 || (n >= 0 && t.dim_size(0) != n)) {
    return tf::errors::InvalidArgument("`", name, "` must be a vector",
                                       n >= 0 ? " of length " + std::to_string(n) : "",
                                       ", got shape ", t.shape().DebugString());
  }
  return absl::OkStatus();
}

// A 2-D input [rows, cols]; -1 accepts any size in that dimension.
inline absl::Status Matrix(const tf::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  if (t.dims() != 2 || (rows >= 0 && t.dim_size(0) != rows) ||
      (cols >= 0 && t.dim_size(1) != cols)) {
    return tf::errors::InvalidArgument(
        "`", name, "` must be [", rows >= 0 ? std::to_string(rows) : "rows", ", ",
        cols >= 0 ? std::to_string(cols) : "cols", "], got ", t.shape().DebugString());
  }
  return absl::OkStatus();
}

// `keys` a vector of n keys and `rows` (named `rows_name`) their rows, an
// [n, cols] matrix; sets *n.
inline absl::Status KeysAndRows(const tf::Tensor& keys, const tf::Tensor& rows,
                                const char* rows_name, int64_t cols, int64_t* n) {
  TF_RETURN_IF_ERROR(Vector(keys, "keys"));
  *n = keys.dim_size(0);
  return Matrix(rows, rows_name, *n, cols);
}

// Row splits of a ragged batch over nnz values: a vector of at least one
// entry that starts at 0, never decreases and ends at nnz. Checked in full
// before any row is read, so no split can point outside the values.
inline absl::Status Splits(const tf::Tensor& t, int64_t nnz, const std::string& name) {
  if (t.dims() != 1 || t.dim_size(0) < 1) {
    return tf::errors::InvalidArgument("`", name,
                                       "` must be a vector of batch + 1 >= 1 "
                                       "row splits, got shape ",
                                       t.shape().DebugString());
  }
  const auto s = t.flat<int64_t>();
  const int64_t n = t.dim_size(0);
  if (s(0) != 0) {
    return tf::errors::InvalidArgument("`", name, "` must start at 0, got ", s(0));
  }
  for (int64_t i = 1; i < n; ++i) {
    if (s(i) < s(i - 1)) {
      return tf::errors::InvalidArgument("`", name, "` must be non-decreasing, got ", s(i - 1),
                                         " then ", s(i), " at position ", i);
    }
  }
  if (s(n - 1) != nnz) {
    return tf::errors::InvalidArgument("`", name, "` must end at the number of values, ", nnz,
                                       ", got ", s(n - 1));
  }
  return absl::OkStatus();
}

// Every value of `v[0..n)` in [lo, hi).
template <typename T>
absl::Status InRange(const T* v, int64_t n, int64_t lo, int64_t hi, const std::string& name) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = static_cast<int64_t>(v[i]);
    if (x < lo || x >= hi) {
      return tf::errors::InvalidArgument(name, "[", i, "] = ", x, " is not in [", lo, ", ", hi,
                                         ")");
    }
  }
  return absl::OkStatus();
}

// Every value of `v[0..n)` >= lo.
template <typename T>
absl::Status AtLeast(const T* v, int64_t n, T lo, const std::string& name) {
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] < lo) {
      return tf::errors::InvalidArgument(name, "[", i, "] = ", v[i], " must be >= ", lo);
    }
  }
  return absl::OkStatus();
}

// No NaN or infinity among `v[0..n)`; `row_width` > 0 reports the row.
inline absl::Status Finite(const float* v, int64_t n, const std::string& name,
                           int64_t row_width = 0) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) {
      if (row_width > 0) {
        return tf::errors::InvalidArgument("`", name, "` holds ", v[i], " in row ", i / row_width,
                                           "; only finite values are allowed");
      }
      return tf::errors::InvalidArgument("`", name, "`[", i, "] = ", v[i],
                                         "; only finite values are allowed");
    }
  }
  return absl::OkStatus();
}

// A vector of distinct, non-empty names.
inline absl::Status UniqueNames(const tf::Tensor& t, const char* name) {
  TF_RETURN_IF_ERROR(Vector(t, name));
  std::unordered_set<std::string> seen;
  const auto v = t.flat<tf::tstring>();
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    const std::string s(v(i));
    if (s.empty()) {
      return tf::errors::InvalidArgument("`", name, "`[", i,
                                         "] is empty; names must be "
                                         "non-empty");
    }
    if (!seen.insert(s).second) {
      return tf::errors::InvalidArgument("`", name, "` names '", s,
                                         "' twice; each must "
                                         "appear once");
    }
  }
  return absl::OkStatus();
}

// Distinct keys: the first repeated key is reported.
template <typename K>
absl::Status UniqueKeys(const K* keys, int64_t n, const std::string& name) {
  std::unordered_set<K> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (!seen.insert(keys[i]).second) {
      return tf::errors::InvalidArgument("`", name, "` holds key ", keys[i],
                                         " twice; each key must appear once");
    }
  }
  return absl::OkStatus();
}

// One slot width in [1, kMaxSlotWidth].
inline absl::Status SlotWidth(int64_t w, const std::string& name) {
  if (w < 1 || w > kMaxSlotWidth) {
    return tf::errors::InvalidArgument("`", name, "` = ", w, " must be in [1, ", kMaxSlotWidth,
                                       "]");
  }
  return absl::OkStatus();
}

// A vector of slot widths, each in [1, kMaxSlotWidth]; *total is their sum.
inline absl::Status SlotWidths(const tf::Tensor& t, const char* name, int64_t* total) {
  TF_RETURN_IF_ERROR(Vector(t, name));
  *total = 0;
  const auto w = t.flat<int64_t>();
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    TF_RETURN_IF_ERROR(SlotWidth(w(i), std::string(name) + "[" + std::to_string(i) + "]"));
    *total += w(i);  // at most 2^20 per entry of a vector: no overflow
  }
  return absl::OkStatus();
}

}  // namespace validate
}  // namespace kre

#endif  // KRE_KERNELS_VALIDATE_H_
