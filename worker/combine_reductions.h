// All-reductions that nothing needs in between, run as one: a worker-side rewrite of a program
// before it is compiled (XLA's AllReduceCombiner; DDP's and Horovod's gradient buckets).
#ifndef MESHRUN_WORKER_COMBINE_REDUCTIONS_H_
#define MESHRUN_WORKER_COMBINE_REDUCTIONS_H_

#include <cstddef>

#include "meshrun/v1/program.pb.h"

namespace meshrun {

// Rewrites the one function of `program` (`max_bytes`, `direct_min_bytes`: CollectiveOptions'
// combine_max_bytes and direct_min_bytes; max_bytes 0 leaves it as it is):
//  1. an update that all-reduces its partial operand itself (OP_ADAM_UPDATE with grad axes, or
//     OP_FUSED_ELEMENTWISE with axis_names) over an operand of fewer than `max_bytes` that is not
//     single-copy (fewer than direct_min_bytes, or direct_min_bytes 0) is split into the
//     OP_PSUM / OP_PMEAN of the operand into a new buffer and the update of the reduced one
//     (an Adam update's reduce_dtype bf16 included: a bucketed gradient is summed in f32 with
//     the step's other small reductions, one meeting of the group for all of them, where bf16
//     would save bytes that cost nothing);
//  2. f32 OP_PSUM / OP_PMEAN ops over the same axes, each of fewer than `max_bytes`, are
//     delayed until an op needs one of their results (or writes one of their operands), joined
//     there by every later one whose operand is final by then, and run as one OP_PSUM with
//     several operands (jax.lax.psum of a pytree; `fn` says per operand 's' sum or 'm' mean),
//     which the executor reduces as one bucket. Larger ones stay where they are (reduced in
//     place, single-copy). The updates of a run of consecutive Adam updates are reordered: those
//     that reduce their own gradient first;
//  3. a combined reduction (of fewer than `max_bytes` in all) right before or after an update
//     (Adam's, or an element-wise one) whose partial operand is reduced single-copy over the same
//     axes (at least `direct_min_bytes`; never with direct_min_bytes 0) joins that update as its
//     riders: its operands and results appended to the update's (after the element-wise
//     update's own), its letters to its fn ("mean:ssm"). The executor sums them in the
//     same meeting of the group as the gradient, so a data-parallel step meets its peers once
//     (the loss and the small gradients ride with the large gradient), as the one flat gradient
//     buffer of DDP or Horovod does.
// Each rank rewrites the same program alike, so every rank runs the same collectives in the same
// order. Each element is the same sum or mean of the same terms; with more than two ranks they may
// be added in another order (as the ring adds them for another message size).
void CombineReductions(v1::StepProgram* program, size_t max_bytes, size_t direct_min_bytes);

}  // namespace meshrun

#endif  // MESHRUN_WORKER_COMBINE_REDUCTIONS_H_
