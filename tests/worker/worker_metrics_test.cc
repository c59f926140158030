// WorkerMetrics' kernel histograms: by kernel, and a matmul's also by its shape when asked
// (--kernel_shape_labels, what `meshrun bench kernels` reads); MatmulShapeLabel's format.
#include "worker/worker_metrics.h"

#include <set>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace meshrun {
namespace {

// The label sets of meshrun_kernel_duration_seconds' series, as "kernel=...,shape=...".
std::set<std::string> KernelSeries(prometheus::Registry& registry) {
  std::set<std::string> out;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != "meshrun_kernel_duration_seconds") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      std::string labels;
      for (const prometheus::ClientMetric::Label& l : m.label)
        labels += (labels.empty() ? "" : ",") + l.name + "=" + l.value;
      out.insert(labels);
    }
  }
  return out;
}

TEST(WorkerMetricsTest, MatmulsAreLabelledByShapeOnlyWhenAsked) {
  const std::string shape = "[8,1024]x[1024,1024] f32->f32 relu";
  prometheus::Registry plain_registry, shaped_registry;
  WorkerMetrics plain(plain_registry), shaped(shaped_registry, /*shape_labels=*/true);
  for (WorkerMetrics* m : {&plain, &shaped}) {
    m->ForKernel("matmul", shape)(absl::Microseconds(5));
    m->ForKernel("unary", "")(absl::Microseconds(1));
  }
  EXPECT_EQ(KernelSeries(plain_registry), (std::set<std::string>{"kernel=matmul", "kernel=unary"}));
  EXPECT_EQ(KernelSeries(shaped_registry),
            (std::set<std::string>{"kernel=matmul,shape=" + shape, "kernel=unary"}));
}

TEST(WorkerMetricsTest, MatmulShapeLabelNamesOperandsDtypesAndAttributes) {
  v1::Op op;
  op.set_kind(v1::OP_MATMUL);
  op.add_inputs("x");
  op.add_inputs("w");
  EXPECT_EQ(MatmulShapeLabel(op, {32, 784}, {784, 512}, v1::DTYPE_F32, v1::DTYPE_F32),
            "[32,784]x[784,512] f32->f32");
  op.add_inputs("bias");
  op.set_transpose_a(true);
  op.set_transpose_b(true);
  op.set_fn("silu");
  EXPECT_EQ(MatmulShapeLabel(op, {784, 32}, {512, 784}, v1::DTYPE_BF16, v1::DTYPE_F32),
            "[784,32]x[512,784] bf16->f32 ta tb +bias silu");
  v1::Op acc;
  acc.set_kind(v1::OP_MATMUL);
  acc.set_accumulate(true);
  EXPECT_EQ(MatmulShapeLabel(acc, {4, 2, 3}, {4, 3, 5}, v1::DTYPE_BF16, v1::DTYPE_BF16),
            "[4,2,3]x[4,3,5] bf16->bf16 acc");
}

}  // namespace
}  // namespace meshrun
