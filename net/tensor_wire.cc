#include "net/tensor_wire.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpc/slice.h"
#include "grpcpp/support/proto_buffer_reader.h"

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

void AppendField(std::vector<grpc::Slice>& out, int field, std::vector<grpc::Slice> contents) {
  size_t length = 0;
  for (const grpc::Slice& s : contents) length += s.size();
  std::string head;
  AppendVarint(head, (static_cast<uint64_t>(field) << 3) | 2);
  AppendVarint(head, length);
  out.emplace_back(head);
  for (grpc::Slice& s : contents) out.push_back(std::move(s));
}

absl::StatusOr<std::vector<grpc::Slice>> SoleFieldContents(const grpc::ByteBuffer& bytes,
                                                           int field) {
  std::vector<grpc::Slice> slices;
  if (grpc::Status s = bytes.Dump(&slices); !s.ok()) {
    return absl::InvalidArgumentError("the message's bytes cannot be read");
  }
  // The tag and length: at most 5 + 10 bytes, perhaps over several slices.
  uint8_t head[15];
  size_t have = 0, total = 0;
  for (const grpc::Slice& s : slices) {
    const size_t take = std::min(sizeof(head) - have, s.size());
    std::memcpy(head + have, s.begin(), take);
    have += take;
    total += s.size();
  }
  google::protobuf::io::CodedInputStream in(head, static_cast<int>(have));
  uint64_t length = 0;
  if (in.ReadTag() != ((static_cast<uint32_t>(field) << 3) | 2) || !in.ReadVarint64(&length) ||
      in.CurrentPosition() + length != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("the message's ", total, " bytes are not one length-delimited field ", field));
  }
  size_t skip = in.CurrentPosition();
  std::vector<grpc::Slice> contents;
  for (grpc::Slice& s : slices) {
    if (skip >= s.size()) {
      skip -= s.size();
      continue;
    }
    contents.push_back(skip == 0 ? std::move(s) : s.sub(skip, s.size()));
    skip = 0;
  }
  return contents;
}

absl::Status ParseWithTensor(const grpc::ByteBuffer& bytes, int tensor_field,
                             google::protobuf::MessageLite* rest, Tensor* tensor) {
  grpc::ByteBuffer shared(bytes);  // (shares its slices; the reader consumes them)
  grpc::ProtoBufferReader reader(&shared);
  return ParseWithTensor(&reader, static_cast<int64_t>(bytes.Length()), tensor_field, rest, tensor);
}

absl::Status ParseWithTensors(const grpc::ByteBuffer& bytes, int tensor_field,
                              google::protobuf::MessageLite* rest, std::vector<Tensor>* tensors) {
  grpc::ByteBuffer shared(bytes);
  grpc::ProtoBufferReader reader(&shared);
  return ParseWithTensors(&reader, static_cast<int64_t>(bytes.Length()), tensor_field, rest,
                          tensors);
}

}  // namespace meshrun
