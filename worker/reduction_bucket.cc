#include "worker/reduction_bucket.h"

#include <cstring>

namespace meshrun {

void PackBucket(const std::vector<Tensor*>& in, float* bucket) {
  for (const Tensor* x : in) {
    std::memcpy(bucket, x->raw(), x->size_bytes());
    bucket += x->num_elements();
  }
}

void UnpackBucket(const float* sums, const std::vector<Tensor*>& out, const std::string& kinds,
                  float inv) {
  for (size_t i = 0; i < out.size(); ++i) {
    float* y = out[i]->data<float>();
    const int64_t n = out[i]->num_elements();
    if (kinds[i] == 'm') {
      for (int64_t e = 0; e < n; ++e) y[e] = sums[e] * inv;
    } else {
      std::memcpy(y, sums, static_cast<size_t>(n) * sizeof(float));
    }
    sums += n;
  }
}

}  // namespace meshrun
