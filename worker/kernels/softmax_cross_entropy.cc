// Softmax cross-entropy with integer labels: oneDNN logsoftmax, then the per-row loss, argmax and
// gradient (softmax - onehot) / b over the [b, c] log-probabilities.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/kernels/engine.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

using kernels::CpuEngine;
using kernels::Guard;
using kernels::Bind;
using kernels::BoundMemory;
using kernels::RowMajorDesc;

namespace {

class SoftmaxCrossEntropyKernel : public Kernel {
 public:
  SoftmaxCrossEntropyKernel(const Tensor& logits, const Tensor& labels, Tensor* dlogits, Tensor& loss_sum,
                            Tensor& correct)
      : logits_(logits),
        labels_(labels),
        dlogits_(dlogits),
        loss_sum_(loss_sum),
        correct_(correct),
        logp_(v1::DTYPE_F32, logits.dims()),
        stream_(CpuEngine()) {}

  absl::Status Init() {
    return Guard("logsoftmax", [&] {
      auto md = RowMajorDesc(logits_.dims());
      dnnl::logsoftmax_forward::primitive_desc pd(
          dnnl::logsoftmax_forward::desc(dnnl::prop_kind::forward_inference, md, 1), CpuEngine());
      prim_ = dnnl::logsoftmax_forward(pd);
      src_ = Bind(md, logits_);
      args_ = {{DNNL_ARG_SRC, src_.memory}, {DNNL_ARG_DST, Bind(md, logp_).memory}};  // logp_ is ours: fixed
    });
  }

  absl::Status Run() override {
    absl::Status s = Guard("logsoftmax", [&] {
      src_.Rebind();
      prim_.execute(stream_, args_);
      stream_.wait();
    });
    if (!s.ok()) return s;
    const int64_t b = logits_.dims()[0], c = logits_.dims()[1];
    const float* logp = logp_.data<float>();
    const float* logits = logits_.data<float>();
    const int32_t* labels = labels_.data<int32_t>();
    float* dl = dlogits_ ? dlogits_->data<float>() : nullptr;
    const float inv_b = 1.0f / static_cast<float>(b);
    double loss = 0, hits = 0;
    for (int64_t i = 0; i < b; ++i) {
      const int32_t y = labels[i];
      const float* row = logp + i * c;
      if (y >= c) return absl::InvalidArgumentError(absl::StrCat("label ", y, " out of range [0, ", c, ")"));
      if (dl != nullptr) {
        for (int64_t j = 0; j < c; ++j) dl[i * c + j] = (y < 0) ? 0.0f : (std::exp(row[j]) - (j == y)) * inv_b;
      }
      if (y < 0) continue;  // padding row
      loss -= row[y];
      int64_t arg = 0;
      for (int64_t j = 1; j < c; ++j) {
        if (logits[i * c + j] > logits[i * c + arg]) arg = j;
      }
      hits += (arg == y);
    }
    *loss_sum_.data<float>() += static_cast<float>(loss);
    *correct_.data<float>() += static_cast<float>(hits);
    return absl::OkStatus();
  }

 private:
  const Tensor& logits_;
  const Tensor& labels_;
  Tensor* dlogits_;
  Tensor& loss_sum_;
  Tensor& correct_;
  Tensor logp_;
  dnnl::stream stream_;
  dnnl::primitive prim_;
  BoundMemory src_;
  std::unordered_map<int, dnnl::memory> args_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateSoftmaxCrossEntropy(const Tensor& logits, const Tensor& labels,
                                                                  Tensor* dlogits, Tensor& loss_sum,
                                                                  Tensor& correct) {
  if (logits.dims().size() != 2 || labels.dims().size() != 1 || labels.dims()[0] != logits.dims()[0] ||
      labels.dtype() != v1::DTYPE_I32) {
    return absl::InvalidArgumentError(absl::StrCat("softmax_cross_entropy: logits ", DimsToString(logits.dims()),
                                                   " and labels ", DTypeName(labels.dtype()),
                                                   DimsToString(labels.dims()), "; expected [b, c] and i32[b]"));
  }
  if (dlogits != nullptr && dlogits->dims() != logits.dims()) {
    return absl::InvalidArgumentError("softmax_cross_entropy: dlogits shape differs from logits");
  }
  auto kernel = std::make_unique<SoftmaxCrossEntropyKernel>(logits, labels, dlogits, loss_sum, correct);
  if (absl::Status s = kernel->Init(); !s.ok()) return s;
  return std::unique_ptr<Kernel>(std::move(kernel));
}

}  // namespace meshrun
