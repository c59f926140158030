// JitBuilder: a program written on GLOBAL arrays, as for one device, with shardings only on its
// inputs, outputs and chosen intermediates; build() partitions it into the per-shard program the
// workers run, choosing each op's local computation and inserting the collectives where layouts
// disagree. Mirrors jax.jit(f, in_shardings=..., out_shardings=...) with
// jax.lax.with_sharding_constraint, partitioned the way XLA's GSPMD does (the per-op rules are
// core/spmd/sharding_rules.h).
//
//   JitBuilder jit(*Mesh::Parse("data=2,model=4"));
//   auto x  = jit.Input(v1::DTYPE_F32, {8, 1024}, P("data", None));
//   auto w1 = jit.Input(v1::DTYPE_F32, {1024, 4096}, P(None, "model"));
//   auto w2 = jit.Input(v1::DTYPE_F32, {4096, 1024}, P("model", None));
//   jit.Output(jit.Dot(jit.Unary("relu", jit.Dot(x, w1)), w2), P("data", None));
//   jit.collectives();   // [psum over (model): 4096 bytes per device]
//   client->ShardMap(*jit.Build(), {"x", "w1", "w2"});
//
// Shapes are global and row-major. Partitioning is eager: each op is partitioned as it is added,
// from its operands' layouts; a value holding partial sums (after a dot over a sharded
// contracting dim, or a reduction over a sharded dim) is completed when it is next used: by a
// psum before another op, or by a psum_scatter when a sharding constraint or output spec wants
// it sharded over the partial axes.
//
// Not thread-safe. The first error (a shape or spec that does not fit) is recorded with the op
// that caused it and returned by Build(); ops added after it are ignored.
#ifndef MESHRUN_CLIENT_JIT_H_
#define MESHRUN_CLIENT_JIT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/spmd/sharding_rules.h"
#include "core/tensor.h"
#include "meshrun/shard_map.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

class JitBuilder {
 public:
  struct Value {
    int id = -1;
  };
  // One collective the partitioner inserted.
  struct Collective {
    std::string op;                 // all_gather, psum, psum_scatter, pmean, pmax
    std::vector<std::string> axes;  // mesh axes it runs over
    int64_t dim = -1;               // all_gather / psum_scatter dim
    int64_t bytes_per_device = 0;   // sent by each device (ring algorithms)
    std::string reason;             // the op it serves
  };

  explicit JitBuilder(Mesh mesh) : mesh_(mesh), sm_(std::move(mesh)) {}

  // An argument laid out as `in_spec` (jax.jit's in_shardings).
  Value Input(DType dtype, const Dims& global_dims, const PartitionSpec& in_spec);
  // A result, laid out as `out_spec` (out_shardings).
  void Output(Value v, const PartitionSpec& out_spec);
  // jax.lax.with_sharding_constraint.
  Value WithShardingConstraint(Value v, const PartitionSpec& spec);

  // Element-wise (ShardMapBuilder's functions: tanh, relu, exp, ..., add, sub, mul, div, max).
  // Binary operands must have equal shapes.
  Value Unary(const std::string& fn, Value x);
  Value Binary(const std::string& fn, Value a, Value b);
  // jnp.dot of 2-D arrays and jax.lax.dot_general (result: batch, lhs free, rhs free dims).
  Value Dot(Value a, Value b) { return DotGeneral(a, b, {1}, {0}); }
  Value DotGeneral(Value a, Value b, const std::vector<int64_t>& lhs_contracting,
                   const std::vector<int64_t>& rhs_contracting,
                   const std::vector<int64_t>& lhs_batch = {},
                   const std::vector<int64_t>& rhs_batch = {});
  // fn: sum, mean, max over `dims`.
  Value Reduce(const std::string& fn, Value x, const std::vector<int64_t>& dims);

  const Dims& shape(Value v) const { return values_[v.id].global; }
  // The layout chosen for `v` (partial sums not yet completed are not part of it).
  PartitionSpec sharding(Value v) const { return values_[v.id].spec; }
  // The collectives inserted so far, in program order.
  const std::vector<Collective>& collectives() const { return collectives_; }

  absl::StatusOr<v1::ShardMapProgram> Build() const;

 private:
  struct State {
    ShardMapBuilder::Value local;
    DType dtype;
    Dims global;
    PartitionSpec spec;
    std::vector<std::string> partial;  // pending reduction over these axes
    std::string partial_fn;            // sum, mean or max
  };
  Value Add(State s);
  bool Check(bool ok, const std::string& message);
  bool Valid(Value v) const {
    return status_.ok() && v.id >= 0 && v.id < static_cast<int>(values_.size());
  }
  // Completes pending partial results and reshards to `target`; returns the local value.
  State Resolve(const State& s, const PartitionSpec& target, const std::string& reason);
  // Completes pending partial results, keeping the layout.
  State Complete(const State& s, const std::string& reason) { return Resolve(s, s.spec, reason); }
  State ApplyReshards(State s, const std::vector<spmd::Reshard>& reshards,
                      const std::string& reason);

  Mesh mesh_;
  ShardMapBuilder sm_;
  std::vector<State> values_;
  std::vector<Collective> collectives_;
  absl::Status status_;
};

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_JIT_H_
