#include "net/tensor_wire.h"

#include <utility>

#include "google/protobuf/io/coded_stream.h"
#include "grpc/slice.h"

namespace meshrun {

void AppendVarint(std::string& out, uint64_t v) {
  uint8_t buf[10];  // the longest varint
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(v, buf);
  out.append(reinterpret_cast<const char*>(buf), end - buf);
}

std::string TensorFieldPrefix(int field, v1::DType dtype, absl::Span<const int64_t> dims,
                              uint64_t data_bytes) {
  constexpr int kLengthDelimited = 2;
  constexpr char kDataTag = (3 << 3) | kLengthDelimited;  // Tensor.data
  v1::Tensor meta;
  meta.set_dtype(dtype);
  for (int64_t d : dims) meta.mutable_shape()->add_dims(d);
  const std::string meta_bytes = meta.SerializeAsString();
  std::string data_head;
  if (data_bytes > 0) {
    data_head += kDataTag;
    AppendVarint(data_head, data_bytes);
  }
  std::string prefix;
  AppendVarint(prefix, (static_cast<uint64_t>(field) << 3) | kLengthDelimited);
  AppendVarint(prefix, meta_bytes.size() + data_head.size() + data_bytes);
  prefix += meta_bytes;
  prefix += data_head;
  return prefix;
}

grpc::Slice BorrowedSlice(std::shared_ptr<const void> owner, const void* data, size_t bytes) {
  auto* held = new std::shared_ptr<const void>(std::move(owner));
  grpc_slice slice = grpc_slice_new_with_user_data(
      const_cast<void*>(data), bytes,
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, held);
  return grpc::Slice(slice, grpc::Slice::STEAL_REF);
}

}  // namespace meshrun
