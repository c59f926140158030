// Protobuf wire bytes around an array's data, written without building a message that holds the
// data: a header (the enclosing field's tag and length, the Tensor's dtype and shape, Tensor.data's
// tag and length) followed by the data itself, which either is copied once into the same gRPC
// slice or travels as a slice over the caller's memory. The coordinator's PutShard requests and
// the workers' GetShard responses carry blocks this way; the bytes parse as the messages they
// stand for (v1::Tensor in common.proto).
#ifndef MESHRUN_NET_TENSOR_WIRE_H_
#define MESHRUN_NET_TENSOR_WIRE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "meshrun/v1/common.pb.h"

namespace meshrun {

// Appends `v` as a protobuf base-128 varint (1 to 10 bytes).
void AppendVarint(std::string& out, uint64_t v);

// The bytes of length-delimited field number `field` holding a v1::Tensor of `dtype` and `dims`
// (row-major) whose data is `data_bytes` long, up to where that data begins: the field's tag and
// length, the Tensor's dtype and shape fields, then Tensor.data's tag and length (left out when
// `data_bytes` is 0, as proto3 leaves an empty bytes field out). This prefix followed by the
// `data_bytes` bytes of data is byte for byte what protobuf serialises for that field.
// REQUIRES: field >= 1.
std::string TensorFieldPrefix(int field, v1::DType dtype, absl::Span<const int64_t> dims,
                              uint64_t data_bytes);

// A slice over the `bytes` bytes at `data`, not copied: gRPC reads them while it holds the slice,
// and `owner` is released when it lets go of it (on any thread). REQUIRES: `owner` keeps the
// bytes alive and unchanged until then.
grpc::Slice BorrowedSlice(std::shared_ptr<const void> owner, const void* data, size_t bytes);

// Appends to `out` length-delimited field number `field` whose contents are `contents` (its tag
// and length in a slice of their own, then `contents`' slices, shared, not copied).
void AppendField(std::vector<grpc::Slice>& out, int field, std::vector<grpc::Slice> contents);

// The contents of `bytes`, the wire bytes of a message that holds one length-delimited field
// number `field` and nothing else (what protobuf writes for a message with only that field set,
// e.g. GetShardResponse{shard}): slices sharing `bytes`' own, not copied. Errors:
// InvalidArgument for anything else (another first field, bytes beyond the field, too few).
absl::StatusOr<std::vector<grpc::Slice>> SoleFieldContents(const grpc::ByteBuffer& bytes,
                                                           int field);

// ParseWithTensor (core/tensor.h) over the wire bytes of a gRPC message, read in place from its
// slices: the Tensor field's data copied once, into the Tensor.
absl::Status ParseWithTensor(const grpc::ByteBuffer& bytes, int tensor_field,
                             google::protobuf::MessageLite* rest, Tensor* tensor);
// ParseWithTensors (core/tensor.h) over the wire bytes of a gRPC message, read in place.
absl::Status ParseWithTensors(const grpc::ByteBuffer& bytes, int tensor_field,
                              google::protobuf::MessageLite* rest, std::vector<Tensor>* tensors);

}  // namespace meshrun

#endif  // MESHRUN_NET_TENSOR_WIRE_H_
