// Single-copy collectives among ranks that reach each other's memory (Transport::peer_memory), as
// NCCL's P2P transport reduces straight out of a peer GPU's buffer and Open MPI's XPMEM path out
// of a peer process's pages. No payload travels as a message; each collective runs in three
// phases:
//
//   1. Exchange: every rank exports its buffer and sends the handle to every other member of the
//      group (one small message each), then receives theirs. A rank whose buffer is not in
//      shareable memory sends an empty handle; if any handle is empty, every rank sees it and all
//      return kFellBack having touched nothing, so they fall back to the ring together.
//   2. Work, on disjoint bytes (no two ranks write the same bytes, none reads bytes another
//      writes), chunk by chunk (at most chunk_bytes, and 64 KiB, so a scratch chunk stays in
//      cache):
//        all-reduce (in place, P segments cut as the ring cuts them, ring_util.h): position p
//          reduces segment p of every member's buffer in group order into a scratch chunk (so the
//          bits do not depend on which rank computed them), scales it by 1/P for pmean, and
//          stores it into segment p of every member's buffer, its own included;
//        all-reduce + update (DirectAllReduceUpdate): position p reduces segment p as the
//          all-reduce does, computes the update of that segment into its own outputs and stores
//          them into every other member's (non-temporal stores: the peer reads them next step);
//        reduce-scatter: position p reduces block p of every member's input, in group order,
//          into its own output;
//        all-gather: position p copies every member's block into its own output.
//   3. Finish: every rank sends "done" to every other member and waits for theirs: after that no
//      peer reads or writes its buffer any more.
//
// An all-reduce reads the buffer's size once and writes it once per rank, against the ring's
// copy of 2(P-1)/P of it into messages, the same out of them and the reduction in between; with P
// processes on a few cores that memory traffic, not latency, is what a large collective costs.
//
// Caveat: a rank that gives up (deadline, Abort) after phase 1 cannot stop peers still in phase
// 2 from reading or writing its buffer; the program has failed by then, and they finish within
// the step.
#ifndef MESHRUN_CORE_COLLECTIVES_DIRECT_COLLECTIVES_H_
#define MESHRUN_CORE_COLLECTIVES_DIRECT_COLLECTIVES_H_

#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "core/collectives/communicator.h"

namespace meshrun {

enum class DirectResult { kDone, kFellBack };

// REQUIRES for all of them: comm.ReachesAllMembers(). Errors: those of Transport (naming the rank
// that failed or timed out), PeerMemory::Import's (naming the rank whose memory could not be
// mapped), CheckReducible's for the reductions.

// In-place all-reduce of `count` elements at `data` (psum / pmean / pmax).
absl::StatusOr<DirectResult> DirectAllReduce(Communicator& comm, void* data, int64_t count,
                                             DType dtype, ReduceOp op);
// `in`: size() blocks of `count` elements; `out` (count elements) gets the reduction of block
// index() (psum_scatter, tiled). REQUIRES: `out` does not overlap `in`.
absl::StatusOr<DirectResult> DirectReduceScatter(Communicator& comm, const void* in, int64_t count,
                                                 DType dtype, ReduceOp op, void* out);
// `in`: `count` elements; `out` (size() * count) gets block i from position i (all_gather,
// tiled). REQUIRES: `out` does not overlap `in`.
absl::StatusOr<DirectResult> DirectAllGather(Communicator& comm, const void* in, int64_t count,
                                             DType dtype, void* out);

// An all-reduce fused with the elementwise update that consumes it, whose inputs other than the
// reduced buffer are the same on every member (an optimizer step on a parameter replicated over
// the group: XLA's weight-update sharding, with the results left replicated). `partial`: this
// rank's `count` elements to reduce (not modified). Position p reduces segment p of every
// member's `partial` (cut and reduced as DirectAllReduce does, so the same bits) chunk by chunk
// into a scratch chunk, calls update(begin, len, reduced) to write elements [begin, begin + len)
// of this rank's `outputs` (each `count` elements, of out_elems[k] bytes for output k: a master
// weight's bf16 copy beside its f32 update) from it, and stores them
// into every other member's outputs. Each rank reads the reduced buffer's size once and does
// 1/P of the update, instead of every rank doing all of it. kFellBack: nothing computed or
// touched. REQUIRES: update reads no output element outside [begin, begin + len) (an output may
// be its own input, updated in place) and computes what every member would from the same
// reduced values; no output overlaps `partial`.
//
// `extra`, if given: small partial sums reduced in the same session (reductions joined to the
// update's collective, worker/combine_reductions.h, so that a step meets its peers once, not
// twice). Every rank sums all `count` elements of every member's `partial`, in group order, into
// its own `out` (not shared), as a psum of them would: they are too small to be worth cutting
// into segments. REQUIRES: `partial` is in memory the transport can export (else kFellBack for
// the whole call), of `dtype` (which may differ from the update's: f32 riders beside a gradient
// reduced in bf16); `out` overlaps nothing else.
struct DirectExtraSum {
  const void* partial;
  int64_t count;
  void* out;
  DType dtype = v1::DTYPE_F32;
};
absl::StatusOr<DirectResult> DirectAllReduceUpdate(
    Communicator& comm, const void* partial, int64_t count, DType dtype, ReduceOp op,
    const std::vector<void*>& outputs, const std::vector<size_t>& out_elems,
    absl::FunctionRef<void(int64_t begin, int64_t len, const void* reduced)> update,
    const DirectExtraSum* extra = nullptr);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_DIRECT_COLLECTIVES_H_
