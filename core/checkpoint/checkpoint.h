// Sharded checkpoints on disk: the format, the manifest and the restore planner.
//
// A checkpoint is a directory <root>/step_<N> (N zero-padded to 8 digits) holding
//   shard-<rank>.safetensors   one per worker that owns a block: the blocks that worker wrote,
//                              each a safetensors tensor named "<array>@<block offsets>", e.g.
//                              "params/mlp/W1@0,0,256" (safetensors: an 8-byte little-endian
//                              header size, a JSON header, then the raw little-endian data;
//                              Python's safetensors and numpy read it as is);
//   manifest.json              written last: format version, step, mesh, and per array its
//                              global shape, dtype and PartitionSpec at save time and every block:
//                              offsets, shape, file, byte range in the file and CRC-32 (zlib).
// A replicated block is written once, by the lowest rank holding it (Orbax and PyTorch DCP
// dedupe the same way). Saves are written under <root>/step_<N>.tmp-<nonce>, fsynced, and
// committed by renaming the directory (then fsyncing <root>): a crash at any moment leaves the
// previous checkpoint intact; leftovers without a manifest are ignored and removed by the next
// save.
//
// Restoring into another layout: each worker computes its target block and reads only the saved
// blocks that intersect it (their byte ranges), verifying each block's CRC-32.
//
// Thread-safety: free functions; safe to call concurrently on different paths.
#ifndef MESHRUN_CORE_CHECKPOINT_CHECKPOINT_H_
#define MESHRUN_CORE_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"

namespace meshrun::checkpoint {

inline constexpr int kFormatVersion = 1;

// One saved block of an array.
struct Block {
  std::vector<int64_t> offsets;  // start index along every dim of the global array
  Dims shape;                    // the block's shape
  std::string file;              // relative to the checkpoint directory
  std::string tensor;            // its name inside the safetensors file
  int64_t data_offset = 0;       // absolute byte offset in `file`
  int64_t nbytes = 0;
  uint32_t crc32 = 0;  // zlib crc32 of the block's bytes
};

struct ArrayEntry {
  std::string name;  // "params/mlp/W1"
  DType dtype = v1::DTYPE_F32;
  Dims shape;                 // global
  PartitionSpec spec;         // at save time
  std::vector<Block> blocks;  // together they tile the array exactly once
};

struct Manifest {
  int format_version = kFormatVersion;
  int64_t step = 0;
  std::string mesh;  // Mesh::ToString() at save time
  std::vector<ArrayEntry> arrays;

  const ArrayEntry* Find(const std::string& name) const;
};

std::string ToJson(const Manifest& m);
// Errors: DataLoss for malformed JSON or a missing field; FailedPrecondition for an unknown
// format_version (naming it and the supported one).
absl::StatusOr<Manifest> ParseManifest(const std::string& json);
absl::StatusOr<Manifest> ReadManifest(const std::string& checkpoint_dir);

// "step_00000040".
std::string StepDirName(int64_t step);
// The committed checkpoints under `root` (directories step_N holding a manifest.json), by step.
std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& root);
// The newest committed checkpoint's directory. Errors: NotFound naming `root`.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// The blocks of `a` a device whose target block starts at `offsets` with `shape` must read.
std::vector<const Block*> BlocksIntersecting(const ArrayEntry& a,
                                             const std::vector<int64_t>& offsets,
                                             const Dims& shape);

// Copies the part of `src` (a block at src_offsets) inside `dst` (a block at dst_offsets), both
// row-major of the same dtype. Returns the number of elements copied (0 when they do not meet).
int64_t CopyIntersection(const Tensor& src, const std::vector<int64_t>& src_offsets, Tensor& dst,
                         const std::vector<int64_t>& dst_offsets);

// Writes `tensors` as one safetensors file at `path` and fsyncs it. Returns, per tensor, its
// absolute data offset in the file. Errors: Internal / ResourceExhausted (disk full) naming the
// path.
absl::StatusOr<std::vector<int64_t>> WriteSafetensors(
    const std::string& path, const std::vector<std::pair<std::string, const Tensor*>>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata = {});

// Reads a safetensors file whole: its tensors by name, in file order (F32, BF16, I32, U32).
// Errors: NotFound / DataLoss naming the path and what is wrong.
absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> ReadSafetensors(
    const std::string& path);

// A plain safetensors file (one unsharded tensor per name, e.g. from Python or `meshrun export`)
// seen as a checkpoint: step 0, every tensor one block covering its array, `file` the absolute
// path, CRC-32s computed from the file now. So a job starts from it (`init_from`) by the restore
// path: each worker reads the byte ranges its blocks need. Errors: those of ReadSafetensors.
absl::StatusOr<Manifest> SafetensorsManifest(const std::string& path);

// What a restore reads from `path`: SafetensorsManifest of a file (an init_from of parameters),
// else ReadManifest of a committed checkpoint directory. Errors: theirs.
absl::StatusOr<Manifest> ReadRestoreSource(const std::string& path);

// One saved block of `array`: `nbytes` at byte `data_offset` of the file `path`, as a `dtype`
// block of `shape`, checked against its CRC-32. Errors, each naming the array and the file:
// NotFound (missing file), DataLoss (nbytes not the shape's size, truncated, checksum mismatch).
absl::StatusOr<Tensor> ReadBlockAt(const std::string& path, const std::string& array, DType dtype,
                                   const Dims& shape, int64_t data_offset, int64_t nbytes,
                                   uint32_t crc32);
// Reads every block of `m` (in pieces, allocating no array) and checks its size against its
// shape and its bytes against its CRC-32: what a restore would find, without restoring. One
// message per bad block (naming the array and file), empty when all are sound.
std::vector<std::string> VerifyBlocks(const std::string& checkpoint_dir, const Manifest& m);
// ReadBlockAt for a manifest's block, in <checkpoint_dir>/<block.file>.
absl::StatusOr<Tensor> ReadBlock(const std::string& checkpoint_dir, const ArrayEntry& array,
                                 const Block& block);
// The whole array assembled from its blocks (for export; a restore never does this).
absl::StatusOr<Tensor> ReadArray(const std::string& checkpoint_dir, const ArrayEntry& array);

// What `meshrun ckpt validate` checks before anything is allocated: every wanted array exists
// with the wanted shape and dtype, the target layout fits it on `mesh`; extra arrays are
// reported. bytes_per_worker[r] is what rank r would read.
struct WantedArray {
  std::string name;
  DType dtype = v1::DTYPE_F32;
  Dims shape;
  PartitionSpec spec;
};
struct RestoreReport {
  std::vector<std::string> errors;  // empty: restorable
  std::vector<std::string> extra;   // in the checkpoint, not wanted
  std::vector<int64_t> bytes_per_worker;
};
RestoreReport ValidateRestore(const Manifest& m, const std::vector<WantedArray>& wanted,
                              const Mesh& mesh);

// Writes `data` to `path` (replacing it) and fsyncs it. Errors: Internal / ResourceExhausted
// (disk full) naming the path.
absl::Status WriteFileSynced(const std::string& path, const std::string& data);

// fsync of a directory (after a rename inside it).
absl::Status SyncDir(const std::string& dir);

uint32_t Crc32(const void* data, int64_t nbytes);

}  // namespace meshrun::checkpoint

#endif  // MESHRUN_CORE_CHECKPOINT_CHECKPOINT_H_
