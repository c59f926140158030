// Compiling the shard_map ops: element-wise math, reductions, sort and cumulative ops on oneDNN
// or the worker's kernels, and axis_index; the rest go to CompileLayout (executor_layout_ops.cc),
// CompileRandom and CompileAdamUpdate.
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

absl::Status OpArity(const v1::Op& op, int inputs, int outputs) {
  if ((inputs >= 0 && op.inputs_size() != inputs) || op.outputs_size() != outputs) {
    return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), " takes ", inputs,
                                                   " inputs and ", outputs, " outputs; got ",
                                                   op.inputs_size(), " and ", op.outputs_size()));
  }
  return absl::OkStatus();
}

absl::Status OpOutputMismatch(const v1::Op& op, const Tensor& got, const std::string& expected) {
  return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), ": output is ",
                                                 DTypeName(got.dtype()), DimsToString(got.dims()),
                                                 "; expected ", expected));
}

Executor::CompiledOp FromKernel(absl::StatusOr<std::unique_ptr<Kernel>> k) {
  std::shared_ptr<Kernel> kernel = std::move(*k);
  return [kernel](const RunContext&) { return kernel ? kernel->Run() : absl::OkStatus(); };
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileGeneral(const v1::Op& op,
                                                              const std::vector<Tensor*>& in,
                                                              const std::vector<Tensor*>& out) {
  switch (op.kind()) {
    case v1::OP_UNARY: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      auto k = CreateUnary(op.fn(), *in[0], *out[0], op.value());
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SOFTMAX_CROSS_ENTROPY: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateSoftmaxCrossEntropy(*in[0], *in[1], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SOFTMAX_CROSS_ENTROPY_GRAD: {
      if (absl::Status s = OpArity(op, 3, 1); !s.ok()) return s;
      auto k = CreateSoftmaxCrossEntropyGrad(*in[0], *in[1], *in[2], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_UNARY_GRAD: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateUnaryGrad(op.fn(), *in[0], *in[1], *out[0], op.grad_from_output());
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SELECT: {  // a fused loop of one op
      if (absl::Status s = OpArity(op, 3, 1); !s.ok()) return s;
      auto k = CreateFusedElementwise({{"select", {0, 1, 2}}},
                                      std::vector<const Tensor*>(in.begin(), in.end()), {0}, out);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_FUSED_ELEMENTWISE: {
      if (op.axis_names_size() > 0) return CompileFusedReduceUpdate(op, in, out);
      std::vector<FusedInstruction> instrs;
      for (const v1::FusedInstr& f : op.fused())
        instrs.push_back({f.fn(), std::vector<int>(f.args().begin(), f.args().end())});
      auto k = CreateFusedElementwise(
          instrs, std::vector<const Tensor*>(in.begin(), in.end()),
          std::vector<int>(op.fused_outputs().begin(), op.fused_outputs().end()), out);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_BINARY: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateBinary(op.fn(), *in[0], *in[1], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_REDUCE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      Dims expected = in[0]->dims();
      for (int64_t d : op.dims()) {
        if (d < 0 || d >= static_cast<int64_t>(expected.size())) {
          return absl::InvalidArgumentError(
              absl::StrCat("reduce over dim ", d, " of ", DimsToString(in[0]->dims())));
        }
        expected[d] = 1;
      }
      if (out[0]->dims() != expected) return OpOutputMismatch(op, *out[0], DimsToString(expected));
      auto k = CreateReduce(op.fn(), *in[0], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_ADAM_UPDATE:
      return CompileAdamUpdate(op, in, out);
    case v1::OP_RANDOM_INIT:
    case v1::OP_RANDOM_BITS:
    case v1::OP_DROPOUT_MASK:
    case v1::OP_FOLD_IN:
      return CompileRandom(op, in, out);
    case v1::OP_SORT: {
      if (absl::Status s = OpArity(op, -1, 1); !s.ok()) return s;
      auto k = CreateSort(std::vector<const Tensor*>(in.begin(), in.end()), op.dim(),
                          op.sort_keys(), op.sort_result(), *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_CUMULATIVE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      auto k = CreateCumulative(op.fn(), op.dim(), op.tiled(), *in[0], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_AXIS_INDEX: {
      if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
      std::vector<std::string> axes(op.axis_names().begin(), op.axis_names().end());
      absl::StatusOr<Communicator*> comm = CommunicatorFor(axes);
      if (!comm.ok()) return comm.status();
      if (out[0]->num_elements() != 1) return OpOutputMismatch(op, *out[0], "a scalar");
      Tensor* y = out[0];
      const int index = (*comm)->index();
      return CompiledOp([y, index](const RunContext&) {
        SetFromDouble(*y, 0, index);
        return absl::OkStatus();
      });
    }
    default:
      return CompileLayout(op, in, out);
  }
}

}  // namespace meshrun
