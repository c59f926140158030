// Softmax cross-entropy with integer labels in one pass over the logits: oneDNN's (log-)softmax
// primitive over the class dim, then each row's label picked out.
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::Bind;
using kernels::CpuEngine;
using kernels::Guard;
using kernels::PrimitiveKernel;
using kernels::RowMajorDesc;

namespace {

// Row `row`'s label as a class index. Errors: InvalidArgument naming the row and the value when
// it is not an integer in [0, classes).
absl::StatusOr<int64_t> Label(const Tensor& labels, int64_t row, int64_t classes) {
  double v = 0;
  switch (labels.dtype()) {
    case v1::DTYPE_U8:
      v = labels.data<uint8_t>()[row];
      break;
    case v1::DTYPE_I32:
      v = labels.data<int32_t>()[row];
      break;
    case v1::DTYPE_U32:
      v = labels.data<uint32_t>()[row];
      break;
    default:
      v = labels.data<float>()[row];
  }
  if (!(v >= 0 && v < static_cast<double>(classes)) || v != std::floor(v)) {
    return absl::InvalidArgumentError(absl::StrCat("softmax_cross_entropy: label ", v, " of row ",
                                                   row, " is not a class in [0, ", classes, ")"));
  }
  return static_cast<int64_t>(v);
}

absl::Status CheckOperands(const char* op, const Tensor& logits, const Tensor& labels) {
  if (logits.dtype() != v1::DTYPE_F32 || logits.dims().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": logits are ", DTypeName(logits.dtype()),
                                                   DimsToString(logits.dims()),
                                                   "; expected f32[batch, classes]"));
  }
  const DType d = labels.dtype();
  if ((d != v1::DTYPE_U8 && d != v1::DTYPE_I32 && d != v1::DTYPE_U32 && d != v1::DTYPE_F32) ||
      labels.dims() != Dims{logits.dims()[0]}) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": labels are ", DTypeName(d), DimsToString(labels.dims()), "; expected u8, i32, u32 ",
        "or f32 [", logits.dims()[0], "] (one class index per row of the logits)"));
  }
  return absl::OkStatus();
}

// oneDNN's softmax (or log-softmax) of [b, c] rows into `dst`.
absl::StatusOr<std::unique_ptr<Kernel>> SoftmaxRows(const Tensor& logits, Tensor& dst, bool log) {
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("softmax", [&] {
    auto md = RowMajorDesc(logits.dims());
    dnnl::softmax_v2_forward::primitive_desc pd(
        dnnl::softmax_v2_forward::desc(
            dnnl::prop_kind::forward_inference,
            log ? dnnl::algorithm::softmax_log : dnnl::algorithm::softmax_accurate, md, md, 1),
        CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "softmax", dnnl::softmax_v2_forward(pd),
        kernels::Args{{DNNL_ARG_SRC, Bind(md, logits)}, {DNNL_ARG_DST, Bind(md, dst)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

class SoftmaxCrossEntropyKernel : public Kernel {
 public:
  SoftmaxCrossEntropyKernel(const Tensor& logits, const Tensor& labels, Tensor& loss)
      : logits_(logits), labels_(labels), loss_(loss), log_softmax_(v1::DTYPE_F32, logits.dims()) {}
  absl::Status Init() {
    absl::StatusOr<std::unique_ptr<Kernel>> k = SoftmaxRows(logits_, log_softmax_, true);
    if (!k.ok()) return k.status();
    softmax_ = *std::move(k);
    return absl::OkStatus();
  }
  absl::Status Run() override {
    if (absl::Status s = softmax_->Run(); !s.ok()) return s;
    const int64_t rows = logits_.dims()[0], classes = logits_.dims()[1];
    const float* ls = log_softmax_.data<float>();
    float* loss = loss_.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      absl::StatusOr<int64_t> label = Label(labels_, r, classes);
      if (!label.ok()) return label.status();
      loss[r] = -ls[r * classes + *label];
    }
    return absl::OkStatus();
  }

 private:
  const Tensor& logits_;
  const Tensor& labels_;
  Tensor& loss_;
  Tensor log_softmax_;
  std::unique_ptr<Kernel> softmax_;
};

class SoftmaxCrossEntropyGradKernel : public Kernel {
 public:
  SoftmaxCrossEntropyGradKernel(const Tensor& labels, const Tensor& dloss, Tensor& dlogits)
      : labels_(labels), dloss_(dloss), dlogits_(dlogits) {}
  absl::Status Init(const Tensor& logits) {
    absl::StatusOr<std::unique_ptr<Kernel>> k = SoftmaxRows(logits, dlogits_, false);
    if (!k.ok()) return k.status();
    softmax_ = *std::move(k);
    return absl::OkStatus();
  }
  absl::Status Run() override {
    if (absl::Status s = softmax_->Run(); !s.ok()) return s;
    const int64_t rows = dlogits_.dims()[0], classes = dlogits_.dims()[1];
    float* d = dlogits_.data<float>();
    const float* g = dloss_.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      absl::StatusOr<int64_t> label = Label(labels_, r, classes);
      if (!label.ok()) return label.status();
      float* row = d + r * classes;
      row[*label] -= 1.0f;
      for (int64_t c = 0; c < classes; ++c) row[c] *= g[r];
    }
    return absl::OkStatus();
  }

 private:
  const Tensor& labels_;
  const Tensor& dloss_;
  Tensor& dlogits_;
  std::unique_ptr<Kernel> softmax_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateSoftmaxCrossEntropy(const Tensor& logits,
                                                                  const Tensor& labels,
                                                                  Tensor& loss) {
  if (absl::Status s = CheckOperands("softmax_cross_entropy", logits, labels); !s.ok()) return s;
  if (loss.dtype() != v1::DTYPE_F32 || loss.dims() != labels.dims()) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_cross_entropy: loss is ", DTypeName(loss.dtype()),
                     DimsToString(loss.dims()), "; expected f32", DimsToString(labels.dims())));
  }
  if (logits.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  auto kernel = std::make_unique<SoftmaxCrossEntropyKernel>(logits, labels, loss);
  if (absl::Status s = kernel->Init(); !s.ok()) return s;
  return std::unique_ptr<Kernel>(std::move(kernel));
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateSoftmaxCrossEntropyGrad(const Tensor& logits,
                                                                      const Tensor& labels,
                                                                      const Tensor& dloss,
                                                                      Tensor& dlogits) {
  if (absl::Status s = CheckOperands("softmax_cross_entropy_grad", logits, labels); !s.ok())
    return s;
  if (dloss.dtype() != v1::DTYPE_F32 || dloss.dims() != labels.dims() ||
      dlogits.dtype() != v1::DTYPE_F32 || dlogits.dims() != logits.dims()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_cross_entropy_grad: dloss ", DTypeName(dloss.dtype()), DimsToString(dloss.dims()),
        " and dlogits ", DTypeName(dlogits.dtype()), DimsToString(dlogits.dims()), "; expected f32",
        DimsToString(labels.dims()), " and f32", DimsToString(logits.dims())));
  }
  if (logits.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  auto kernel = std::make_unique<SoftmaxCrossEntropyGradKernel>(labels, dloss, dlogits);
  if (absl::Status s = kernel->Init(logits); !s.ok()) return s;
  return std::unique_ptr<Kernel>(std::move(kernel));
}

}  // namespace meshrun
