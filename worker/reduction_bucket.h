// f32 operands side by side in one buffer, all-reduced as one (DDP's gradient buckets): the
// executor's combined psums and an Adam update's riders (worker/combine_reductions.h).
#ifndef MESHRUN_WORKER_REDUCTION_BUCKET_H_
#define MESHRUN_WORKER_REDUCTION_BUCKET_H_

#include <string>
#include <vector>

#include "core/tensor.h"

namespace meshrun {

// Copies every f32 operand of `in`, in order, into `bucket` (their element counts summed).
void PackBucket(const std::vector<Tensor*>& in, float* bucket);

// Writes `sums` (the bucket's sums over the group) to the f32 `out` in order: as they are where
// `kinds` has 's', times `inv` (1 / the group's size: pmean) where it has 'm'.
void UnpackBucket(const float* sums, const std::vector<Tensor*>& out, const std::string& kinds,
                  float inv);

}  // namespace meshrun

#endif  // MESHRUN_WORKER_REDUCTION_BUCKET_H_
