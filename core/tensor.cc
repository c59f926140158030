#include "core/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace meshrun {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
    case v1::DTYPE_I32:
    case v1::DTYPE_U32:
      return 4;
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_U8:
      return 1;
    default:
      return 0;
  }
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_I32:
      return "i32";
    case v1::DTYPE_U32:
      return "u32";
    case v1::DTYPE_U8:
      return "u8";
    default:
      return "unspecified";
  }
}

int64_t NumElements(const Dims& dims) {
  // A zero dim makes the product 0, whatever the other dims (whose product alone may not fit:
  // CheckedByteSize accepts any shape with a zero dim).
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) return 0;
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

int64_t NumElements(const Dims& dims, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end && i < dims.size(); ++i) n *= dims[i];
  return n;
}

std::string DimsToString(const Dims& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

absl::StatusOr<int64_t> CheckedByteSize(DType dtype, const Dims& dims) {
  const int64_t element = static_cast<int64_t>(DTypeSize(dtype));
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("array of shape ", DimsToString(dims), " has no dtype (got ", dtype, ")"));
  }
  for (int64_t d : dims) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dim ", d, " in shape ", DTypeName(dtype), DimsToString(dims)));
    }
  }
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) return 0;
  int64_t bytes = element;
  for (int64_t d : dims) {
    if (__builtin_mul_overflow(bytes, d, &bytes) || bytes > kMaxArrayBytes) {
      return absl::InvalidArgumentError(absl::StrCat("array ", DTypeName(dtype), DimsToString(dims),
                                                     " is larger than the limit of ",
                                                     kMaxArrayBytes, " bytes per array"));
    }
  }
  return bytes;
}

namespace {

struct LargeAllocator {
  size_t min_bytes = 0;
  TensorAllocator allocate;
};

LargeAllocator& Large() {
  static LargeAllocator* large = new LargeAllocator();
  return *large;
}

}  // namespace

void SetLargeTensorAllocator(size_t min_bytes, TensorAllocator allocator) {
  Large().min_bytes = min_bytes;
  Large().allocate = std::move(allocator);
}

std::shared_ptr<void> Tensor::Allocate(size_t bytes, bool shareable) {
  const LargeAllocator& large = Large();
  if (large.allocate && (shareable || bytes >= large.min_bytes)) {
    if (std::shared_ptr<void> p = large.allocate(bytes)) return p;
  }
  const size_t rounded = std::max<size_t>(64, ((bytes + 63) / 64) * 64);
  return std::shared_ptr<void>(std::aligned_alloc(64, rounded), [](void* p) { std::free(p); });
}

Tensor::Tensor(DType dtype, Dims dims) : dtype_(dtype), dims_(std::move(dims)) {
  data_ = Allocate(size_bytes());
  ZeroFill();
}

Tensor Tensor::Uninitialized(DType dtype, Dims dims) {
  Tensor t;
  t.dtype_ = dtype;
  t.dims_ = std::move(dims);
  t.data_ = Allocate(t.size_bytes());
  return t;
}

Tensor Tensor::Shareable(DType dtype, Dims dims) {
  Tensor t;
  t.dtype_ = dtype;
  t.dims_ = std::move(dims);
  t.data_ = Allocate(t.size_bytes(), /*shareable=*/true);
  return t;
}

void Tensor::ZeroFill() {
  std::memset(data_.get(), 0, size_bytes());
  bf16_copy_.reset();
}

Tensor::Tensor(const Tensor& other)
    : dtype_(other.dtype_), dims_(other.dims_), bf16_copy_(other.bf16_copy_) {
  data_ = Allocate(size_bytes());  // every byte is overwritten: no zero-fill first
  std::memcpy(raw(), other.raw(), size_bytes());
}

Tensor Tensor::Alias() const {
  Tensor alias;
  alias.dtype_ = dtype_;
  alias.dims_ = dims_;
  alias.data_ = data_;
  alias.bf16_copy_ = bf16_copy_;
  return alias;
}

void Tensor::ShareMemory(const Tensor& other, size_t byte_offset) {
  data_ = std::shared_ptr<void>(other.data_, static_cast<char*>(other.data_.get()) + byte_offset);
  bf16_copy_.reset();
}

void Tensor::ReplaceStorage() {
  data_ = Allocate(size_bytes());
  bf16_copy_.reset();
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) *this = Tensor(other);
  return *this;
}

v1::Tensor Tensor::ToProto() const {
  v1::Tensor proto;
  proto.set_dtype(dtype_);
  for (int64_t d : dims_) proto.mutable_shape()->add_dims(d);
  proto.set_data(raw(), size_bytes());
  return proto;
}

absl::StatusOr<Tensor> Tensor::FromProto(const v1::Tensor& proto) {
  Dims dims(proto.shape().dims().begin(), proto.shape().dims().end());
  absl::StatusOr<int64_t> bytes = CheckedByteSize(proto.dtype(), dims);
  if (!bytes.ok()) return bytes.status();
  if (proto.data().size() != static_cast<size_t>(*bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", DTypeName(proto.dtype()),
                                                   DimsToString(dims), " needs ", *bytes,
                                                   " bytes, got ", proto.data().size()));
  }
  Tensor t = Uninitialized(proto.dtype(), std::move(dims));
  if (*bytes > 0) std::memcpy(t.raw(), proto.data().data(), *bytes);
  return t;
}

}  // namespace meshrun
