// ParseWithTensor (core/tensor.h): a message's Tensor field read straight into a Tensor.
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/tensor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"

namespace meshrun {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// What the occurrences of the Tensor field said so far, merged as protobuf merges them: the last
// dtype and data, the dims of every shape appended.
struct TensorParts {
  DType dtype = v1::DTYPE_UNSPECIFIED;
  Dims dims;
  // The data, where it went: into `placed` when its length was that of the dtype and dims known
  // then (`placed_dtype`, `placed_dims`), else into `bytes`.
  bool in_placed = false;
  Tensor placed;
  DType placed_dtype = v1::DTYPE_UNSPECIFIED;
  Dims placed_dims;
  std::string bytes;
};

bool ReadData(CodedInputStream& in, TensorParts& t) {
  uint32_t length = 0;
  // (Nothing is allocated for data the message does not hold.)
  if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
    return false;
  }
  absl::StatusOr<int64_t> need = CheckedByteSize(t.dtype, t.dims);
  if (need.ok() && *need == static_cast<int64_t>(length)) {
    t.placed = Tensor::Uninitialized(t.dtype, t.dims);
    if (length > 0 && !in.ReadRaw(t.placed.raw(), static_cast<int>(length))) return false;
    t.in_placed = true;
    t.placed_dtype = t.dtype;
    t.placed_dims = t.dims;
    t.bytes.clear();
    return true;
  }
  t.in_placed = false;
  t.placed = Tensor();
  return in.ReadString(&t.bytes, static_cast<int>(length));
}

// One occurrence of the Tensor field (its length comes first).
bool ReadTensorField(CodedInputStream& in, TensorParts& t) {
  uint32_t length = 0;
  // (A length past the end: a message cut short, whose end a limit-bound read would take for
  // the Tensor's.)
  if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
    return false;
  }
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const WireFormatLite::WireType wire = WireFormatLite::GetTagWireType(tag);
    if (field == 1 && wire == WireFormatLite::WIRETYPE_VARINT) {  // dtype
      uint64_t v = 0;
      if (!in.ReadVarint64(&v)) return false;
      t.dtype = static_cast<DType>(static_cast<int32_t>(v));
    } else if (field == 2 && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {  // shape
      std::string bytes;
      uint32_t n = 0;
      v1::Shape shape;
      if (!in.ReadVarint32(&n) || !in.ReadString(&bytes, static_cast<int>(n)) ||
          !shape.ParseFromString(bytes)) {
        return false;
      }
      t.dims.insert(t.dims.end(), shape.dims().begin(), shape.dims().end());
    } else if (field == 3 && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {  // data
      if (!ReadData(in, t)) return false;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  if (!in.ConsumedEntireMessage()) return false;
  in.PopLimit(limit);
  return true;
}

// The Tensor the parts make, checked as Tensor::FromProto checks one.
absl::StatusOr<Tensor> Assemble(TensorParts& t) {
  absl::StatusOr<int64_t> need = CheckedByteSize(t.dtype, t.dims);
  if (!need.ok()) return need.status();
  const size_t got = t.in_placed ? t.placed.size_bytes() : t.bytes.size();
  if (got != static_cast<size_t>(*need)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", DTypeName(t.dtype),
                                                   DimsToString(t.dims), " needs ", *need,
                                                   " bytes, got ", got));
  }
  if (t.in_placed && t.placed_dtype == t.dtype && t.placed_dims == t.dims) {
    return std::move(t.placed);
  }
  // The data came before the dtype and shape it has in the end (or under others of its size).
  Tensor out = Tensor::Uninitialized(t.dtype, t.dims);
  if (got > 0) std::memcpy(out.raw(), t.in_placed ? t.placed.raw() : t.bytes.data(), got);
  return out;
}

// Reads `stream_bytes` bytes of `stream`, a message's wire bytes: the occurrences of the Tensor
// field into `parts` (one appended for each when `repeated`; else all merged into parts[0]),
// every other field into `rest`. REQUIRES: parts holds one TensorParts when !repeated.
absl::Status ParseFields(google::protobuf::io::ZeroCopyInputStream* stream, int64_t stream_bytes,
                         int tensor_field, bool repeated, google::protobuf::MessageLite* rest,
                         std::vector<TensorParts>& parts) {
  if (stream_bytes < 0 || stream_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("a ", rest->GetTypeName(), " of ", stream_bytes,
                                                   " bytes; protobuf's limit is 2 GiB - 1"));
  }
  std::string others;  // every other field's bytes, for `rest`
  bool ok = true;
  {
    CodedInputStream in(stream);
    in.SetTotalBytesLimit(INT_MAX);
    in.PushLimit(static_cast<int>(stream_bytes));
    google::protobuf::io::StringOutputStream out_stream(&others);
    google::protobuf::io::CodedOutputStream out(&out_stream);
    while (const uint32_t tag = in.ReadTag()) {
      if (WireFormatLite::GetTagFieldNumber(tag) == tensor_field &&
          WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        if (repeated) parts.emplace_back();
        ok = ReadTensorField(in, parts.back());
      } else {
        ok = WireFormatLite::SkipField(&in, tag, &out);
      }
      if (!ok) break;
    }
    ok = ok && in.ConsumedEntireMessage();
  }
  if (!ok || !rest->ParseFromString(others)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", stream_bytes, " bytes are not a ", rest->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseWithTensor(google::protobuf::io::ZeroCopyInputStream* stream,
                             int64_t stream_bytes, int tensor_field,
                             google::protobuf::MessageLite* rest, Tensor* tensor) {
  std::vector<TensorParts> parts(1);
  absl::Status s = ParseFields(stream, stream_bytes, tensor_field, /*repeated=*/false, rest, parts);
  if (!s.ok()) return s;
  absl::StatusOr<Tensor> t = Assemble(parts[0]);
  if (!t.ok()) return t.status();
  *tensor = *std::move(t);
  return absl::OkStatus();
}

absl::Status ParseWithTensors(google::protobuf::io::ZeroCopyInputStream* stream,
                              int64_t stream_bytes, int tensor_field,
                              google::protobuf::MessageLite* rest, std::vector<Tensor>* tensors) {
  std::vector<TensorParts> parts;
  absl::Status s = ParseFields(stream, stream_bytes, tensor_field, /*repeated=*/true, rest, parts);
  if (!s.ok()) return s;
  std::vector<Tensor> out;
  out.reserve(parts.size());
  for (TensorParts& p : parts) {
    absl::StatusOr<Tensor> t = Assemble(p);
    if (!t.ok()) return t.status();
    out.push_back(*std::move(t));
  }
  *tensors = std::move(out);
  return absl::OkStatus();
}

}  // namespace meshrun
