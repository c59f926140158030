// Dense host arrays: dtype, row-major shape and 64-byte-aligned storage.
#ifndef MESHRUN_CORE_TENSOR_H_
#define MESHRUN_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/message_lite.h"
#include "meshrun/v1/common.pb.h"

namespace meshrun {

using DType = v1::DType;

// Bytes per element of `dtype` (0 for DTYPE_UNSPECIFIED).
size_t DTypeSize(DType dtype);
// "f32", "bf16", "i32", "u32".
std::string DTypeName(DType dtype);

// Dimensions of a row-major array; {} is a scalar.
using Dims = std::vector<int64_t>;
int64_t NumElements(const Dims& dims);
// The product of dims[begin, end) (end clipped to dims.size()); 1 for an empty range.
int64_t NumElements(const Dims& dims, size_t begin, size_t end);
std::string DimsToString(const Dims& dims);  // "[128, 784]"

// The largest array meshrun accepts: 2^46 bytes (64 TiB), past any host's memory, so that byte
// counts derived from it stay far inside int64 and size_t.
inline constexpr int64_t kMaxArrayBytes = int64_t{1} << 46;
// The bytes of a row-major array of `dtype` and `dims`, overflow-checked. Every shape that comes
// off the wire or out of a file goes through here before anything is allocated for it. Errors:
// InvalidArgument naming the dtype and shape for an unspecified dtype, a negative dim, or more
// than kMaxArrayBytes (an element count that overflows int64 included).
absl::StatusOr<int64_t> CheckedByteSize(DType dtype, const Dims& dims);

// Where the storage of Tensors of at least `min_bytes` comes from, instead of the heap: a worker
// puts its large arrays in memory that co-located workers can map (worker/shm_arena.h), so a
// collective can read and write them where they lie. The allocator returns 64-byte-aligned
// memory of at least the bytes asked for, freed by the shared_ptr's deleter, or null to fall back
// to the heap. Process-wide; call it before any other thread creates Tensors. A null allocator
// restores the heap for every size.
using TensorAllocator = std::function<std::shared_ptr<void>(size_t bytes)>;
void SetLargeTensorAllocator(size_t min_bytes, TensorAllocator allocator);

// A dense row-major array. Storage is 64-byte aligned so oneDNN can use it directly. Copyable
// (deep copy) and movable. Alias() shares storage without copying, for a worker handing buffers
// between its executor and its shard store. Not thread-safe for concurrent mutation.
class Tensor {
 public:
  Tensor() = default;
  // Zero-initialised array of `dims` elements of `dtype`.
  Tensor(DType dtype, Dims dims);
  // An array whose memory is allocated but not written: contents unspecified. Fresh pages cost
  // no resident memory until written, so a buffer that will only ever be a view of another's
  // memory (ShareMemory) costs nothing if created this way.
  static Tensor Uninitialized(DType dtype, Dims dims);
  // As Uninitialized, from the large-array allocator whatever its size (SetLargeTensorAllocator):
  // a buffer that co-located peers read where it lies, e.g. a bucket of small partial sums that a
  // single-copy collective reduces (direct_collectives.h). The heap without such an allocator.
  static Tensor Shareable(DType dtype, Dims dims);
  Tensor(const Tensor& other);
  Tensor& operator=(const Tensor& other);
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;

  DType dtype() const { return dtype_; }
  const Dims& dims() const { return dims_; }
  int64_t num_elements() const { return NumElements(dims_); }
  size_t size_bytes() const { return num_elements() * DTypeSize(dtype_); }

  void* raw() { return data_.get(); }
  const void* raw() const { return data_.get(); }
  template <typename T>
  T* data() {
    return static_cast<T*>(raw());
  }
  template <typename T>
  const T* data() const {
    return static_cast<const T*>(raw());
  }

  // A Tensor over this one's memory, not a copy: a write through either is seen by both. The
  // owner of a const Tensor that aliases it out must only read through the alias.
  Tensor Alias() const;
  // Makes this Tensor a view of `other`'s memory from `byte_offset` on, keeping its own dtype and
  // dims (a reshape or a contiguous slice without a copy). REQUIRES: byte_offset + size_bytes()
  // <= other.size_bytes().
  void ShareMemory(const Tensor& other, size_t byte_offset);
  // True while another Tensor shares this one's memory.
  bool aliased() const { return data_.use_count() > 1; }
  // Gives this Tensor memory of its own, contents unspecified; its aliases keep the old memory.
  void ReplaceStorage();
  // Sets every element to zero.
  void ZeroFill();

  // This f32 array's values rounded to bf16 (F32ToBf16's bits, core/collectives/reduce_kernels.h),
  // written by whoever wrote the values, or null: an Adam update writes each new master weight's
  // bf16 compute copy beside it, as DeepSpeed's bf16 optimizer does, so the next step's convert
  // to bf16 reads the copy instead of converting again (worker/executor.h). Immutable and shared:
  // copies and aliases of this Tensor carry it. ShareMemory, ReplaceStorage and ZeroFill drop
  // it; whoever writes this Tensor's memory otherwise must drop it (set_bf16_copy(nullptr)).
  const std::shared_ptr<const Tensor>& bf16_copy() const { return bf16_copy_; }
  // REQUIRES: copy is null, or a bf16 array of dims() holding these values' F32ToBf16 bits.
  void set_bf16_copy(std::shared_ptr<const Tensor> copy) { bf16_copy_ = std::move(copy); }

  v1::Tensor ToProto() const;
  // Errors: those of CheckedByteSize; InvalidArgument if the byte count does not match dtype and
  // shape (checked before anything is allocated).
  static absl::StatusOr<Tensor> FromProto(const v1::Tensor& proto);

 private:
  // Uninitialised 64-byte-aligned storage of at least `bytes` bytes (64 for 0).
  static std::shared_ptr<void> Allocate(size_t bytes, bool shareable = false);
  DType dtype_ = v1::DTYPE_UNSPECIFIED;
  Dims dims_;
  std::shared_ptr<void> data_;
  std::shared_ptr<const Tensor> bf16_copy_;  // see bf16_copy()
};

// Parses the `stream_bytes` wire bytes in `stream` of a message whose field number `tensor_field`
// is a v1::Tensor: that Tensor into `tensor`, its data copied once, straight from the stream into
// the Tensor's memory (parsing the message would copy it into a string first, and FromProto again),
// and every other field into `rest`, which protobuf parses. The wire format's rules hold: fields
// in any order, unknown ones skipped, a Tensor sent as several occurrences of its field merged
// (the Python SDK sends dtype and shape, then data). Errors: InvalidArgument for bytes that are
// not such a message (naming rest's type), and FromProto's for the Tensor. Streams of gRPC
// messages: grpc::ProtoBufferReader.
absl::Status ParseWithTensor(google::protobuf::io::ZeroCopyInputStream* stream,
                             int64_t stream_bytes, int tensor_field,
                             google::protobuf::MessageLite* rest, Tensor* tensor);
// As ParseWithTensor, for a message whose field number `tensor_field` is a repeated v1::Tensor:
// each occurrence of the field is one Tensor of `tensors`, in the order they came (protobuf's
// rule for a repeated message field), each checked as FromProto checks one.
absl::Status ParseWithTensors(google::protobuf::io::ZeroCopyInputStream* stream,
                              int64_t stream_bytes, int tensor_field,
                              google::protobuf::MessageLite* rest, std::vector<Tensor>* tensors);

}  // namespace meshrun

#endif  // MESHRUN_CORE_TENSOR_H_
