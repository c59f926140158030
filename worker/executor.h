// Runs a StepProgram (a shard_map program's buffers and function) on one worker: owns the program's
// buffers (this worker's shards) and the kernels compiled from its ops.
#ifndef MESHRUN_WORKER_EXECUTOR_H_
#define MESHRUN_WORKER_EXECUTOR_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collectives/communicator.h"
#include "core/optim/adamw.h"
#include "core/random/threefry.h"
#include "core/sharding/mesh.h"
#include "core/tensor.h"
#include "meshrun/v1/program.pb.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

// What one function call needs from its caller.
// What a run may depend on beyond its buffers (nothing yet: keys and steps are arguments).
struct RunContext {};

// Receives the duration of every op an Executor runs (for metrics). An executor asks once per
// op, when it compiles the program, for a recorder, and calls it after each run of the op, so
// the hot path does no label lookups. Recorders must be thread-safe if shared by executors.
class OpObserver {
 public:
  using Recorder = std::function<void(absl::Duration)>;
  virtual ~OpObserver() = default;
  // A compute or data-movement op: `kernel` is its kind in lower case without OP_ ("matmul");
  // `shape`, for a matmul, its operands as MatmulShapeLabel writes them ("" for other kernels).
  virtual Recorder ForKernel(const std::string& kernel, const std::string& shape) = 0;
  // A collective: its jax.lax name ("psum", "all_gather", ...), its mesh axes ("data", "i,j"),
  // and the bytes of its input.
  virtual Recorder ForCollective(const std::string& op, const std::string& axes, int64_t bytes) = 0;
};

// A GEMM's operands as one label: "[32,784]x[784,512] f32->f32" (a's and b's stored dims, the
// operands' dtype -> the result's), then " ta", " tb", " +bias", " <activation>", " acc" for
// OP_MATMUL's attributes. `meshrun bench kernels` matches a worker's per-shape kernel times to its
// own standalone runs by it.
std::string MatmulShapeLabel(const v1::Op& op, const Dims& a, const Dims& b, DType operands,
                             DType result);
// The kernel options of an OP_MATMUL: transposes, alpha (0, unset, is 1), accumulate, activation.
MatmulOptions MatmulOptionsOf(const v1::Op& op);

// Thread-compatible: one Run at a time. Collectives go through `transport`, which must outlive
// the executor and be connected to every rank of `mesh`.
class Executor {
 public:
  struct Options {
    const Mesh* mesh = nullptr;
    int rank = 0;
    Transport* transport = nullptr;  // may be null for programs without collectives
    CollectiveOptions collectives;
    OpObserver* observer = nullptr;  // optional; must outlive the executor
    // Buffers the caller will take after Run (TakeOutput). An input updated in place is never
    // viewed by one of them (it would show the new values).
    std::vector<std::string> results;
  };

  // Allocates every buffer and compiles every op into a kernel (oneDNN primitives are created
  // here, once). Errors: InvalidArgument naming the op and buffer for unknown buffers, shape
  // mismatches, unknown mesh axes or unsupported ops.
  static absl::StatusOr<std::unique_ptr<Executor>> Create(const v1::StepProgram& program,
                                                          const Options& options);
  // The bytes of every buffer `program` declares, at most (views and buffers written over
  // donated arguments take less), checked before anything is allocated. Errors: those of
  // CheckedByteSize, naming the buffer.
  static absl::StatusOr<int64_t> BufferBytes(const v1::StepProgram& program);

  // Runs function `name`. Errors: NotFound for an unknown function; the failing op's error,
  // prefixed with the function and op index (collective errors name the peer rank).
  absl::Status Run(const std::string& name, const RunContext& ctx);

  // Zero-copy arguments and results. BindInput makes input buffer `name` read `value`'s memory when
  // no op of the program writes that buffer, and copies `value` into it otherwise. Errors:
  // InvalidArgument for an unknown buffer, or naming both dtypes and shapes when `value` does not
  // match the buffer. `donated`: the caller gives up `value` (it holds no other reference to it and
  // will not read it again), so an op that may update in place writes its result into this memory
  // (an Adam update's new param, mu and nu over the old ones), as XLA reuses a donated buffer: when
  // no later op reads the input, and every view of it (a scan's per-layer slices) is read before
  // the update and is not in Options::results. Donation lasts for the next Run.
  absl::Status BindInput(const std::string& name, const Tensor& value, bool donated = false);
  // Buffer `name` (after a Run) as a Tensor over the same memory, not a copy. The executor gives
  // the buffer new memory before its next Run writes it, so the result stays as it is.
  // Errors: InvalidArgument for an unknown buffer.
  absl::StatusOr<Tensor> TakeOutput(const std::string& name);

  // The buffer called `name`, or null. The Tensor stays where it is for the executor's life, but
  // its memory may change from one Run to the next (bound inputs, views, handed-out results).
  Tensor* buffer(const std::string& name);
  const v1::StepProgram& program() const { return program_; }
  const Options& options() const { return options_; }
  // Time spent in collective ops since creation (waiting for peers included).
  absl::Duration collective_time() const { return collective_time_; }
  // When this rank arrived at each collective op (the straggler ledger: the coordinator compares
  // ranks' arrivals at the same collective). `index` counts the collectives of one Run from 0.
  struct Arrival {
    int index;
    const std::string* op;    // jax.lax name: "psum", "all_gather", ...
    const std::string* axes;  // "data", "i,j"
    absl::Time when;
  };
  // The arrivals since the last call (at most kMaxArrivals are kept; later ones are dropped).
  std::vector<Arrival> TakeArrivals() { return std::move(arrivals_); }
  static constexpr size_t kMaxArrivals = 4096;
  // How many runs of consecutive Adam updates run as one sweep over their parameters
  // (JoinAdamUpdates), over all functions; each such run counts once.
  int adam_sweeps() const { return adam_sweeps_; }
  // Bytes held by buffers of `role` (all roles when BUFFER_ROLE_UNSPECIFIED).
  int64_t ResidentBytes(v1::BufferRole role) const;

  using CompiledOp = std::function<absl::Status(const RunContext&)>;

 private:
  struct CompiledFunction {
    const v1::Function* function;
    std::vector<CompiledOp> ops;
    std::vector<OpObserver::Recorder> recorders;  // empty without an observer
    // Per op: its jax.lax collective name and axes ("" for other ops).
    std::vector<std::pair<std::string, std::string>> collectives;
  };
  // The jax.lax name of `op` if it is a collective (a fused all-reduce + Adam update counts as
  // the psum or pmean it replaces), else "".
  static std::string CollectiveName(const v1::Op& op);
  // The observer's recorder for `op`. REQUIRES: options_.observer != nullptr.
  OpObserver::Recorder RecorderFor(const v1::Op& op);
  Executor(const v1::StepProgram& program, const Options& options);
  absl::StatusOr<CompiledOp> Compile(const v1::Op& op);
  // Fills written_, view_ops_, over_donated_, placements_ and reduce_in_place_
  // (executor_buffers.cc), one Plan* each.
  struct BufferUses;
  void AnalyzeBuffers();
  void PlanDonations(BufferUses& u);
  void PlanViews(BufferUses& u);
  std::set<std::string> PlanPlacements(BufferUses& u);  // the parts placed
  void PlanReductionsInPlace(BufferUses& u, const std::set<std::string>& placed);
  void PlanBf16Copies(BufferUses& u);
  // Every input some output may be written over (over_donated_'s candidates).
  std::set<std::string> DonationSources() const;
  // Reshapes and slices: their result may be a view of their input (CompileView).
  static bool IsViewKind(v1::OpKind kind);
  // A view op if `op` is in view_ops_ and its result is one contiguous block of its input.
  std::optional<CompiledOp> CompileView(const v1::Op& op, const Tensor* x, Tensor* y);
  // The shard_map ops other than collectives (executor_general_ops.cc; data movement, random
  // and Adam ops in the files named below).
  absl::StatusOr<CompiledOp> CompileGeneral(const v1::Op& op, const std::vector<Tensor*>& in,
                                            const std::vector<Tensor*>& out);
  // The ops that move data: broadcast, reshape, transpose, concatenate, slices, conversions,
  // fills, rev and iota (executor_layout_ops.cc); InvalidArgument for any other kind.
  absl::StatusOr<CompiledOp> CompileLayout(const v1::Op& op, const std::vector<Tensor*>& in,
                                           const std::vector<Tensor*>& out);
  // The collectives: psum, pmean, pmax, all_gather, psum_scatter, all_to_all, ppermute
  // (executor_collective_ops.cc).
  absl::StatusOr<CompiledOp> CompileCollective(const v1::Op& op, const std::vector<Tensor*>& in,
                                               const std::vector<Tensor*>& out);
  // OP_DYNAMIC_SLICE_ND and OP_DYNAMIC_UPDATE_SLICE (executor_layout_ops.cc).
  absl::StatusOr<CompiledOp> CompileDynamicSlice(const v1::Op& op, const std::vector<Tensor*>& in,
                                                 const std::vector<Tensor*>& out);
  // JAX's PRNG ops: OP_RANDOM_INIT, OP_RANDOM_BITS, OP_DROPOUT_MASK, OP_FOLD_IN,
  // OP_THREEFRY2X32 (executor_random.cc).
  absl::StatusOr<CompiledOp> CompileRandom(const v1::Op& op, const std::vector<Tensor*>& in,
                                           const std::vector<Tensor*>& out);
  // OP_ADAM_UPDATE, with its gradient's all-reduce and joined reductions (executor_adam.cc).
  absl::StatusOr<CompiledOp> CompileAdamUpdate(const v1::Op& op, const std::vector<Tensor*>& in,
                                               const std::vector<Tensor*>& out);
  // Runs of consecutive local Adam updates (IsLocalAdamUpdate) of one step and the same
  // hyperparameters whose arrays share no memory (SharesNoMemory): the first op of each run
  // becomes one AdamWSweep over all of their parameters, the others do nothing. `ops` holds f's
  // ops compiled one by one, each already checked (executor_adam_sweep.cc).
  absl::Status JoinAdamUpdates(const v1::Function& f, std::vector<CompiledOp>& ops);
  // An OP_ADAM_UPDATE that reduces nothing: no grad axes (and no joined reductions), or grad
  // axes whose group is of one (its joined reductions' sums are their operands).
  bool IsLocalAdamUpdate(const v1::Op& op);
  // Whether no two of the run's arrays (its riders' included) are one buffer and none is memory
  // of another buffer's, but for a gradient that an earlier update's rider sums (the riders are
  // copied before the sweep).
  bool SharesNoMemory(const std::vector<const v1::Op*>& run);
  absl::StatusOr<CompiledOp> CompileAdamSweep(const std::vector<const v1::Op*>& run);
  // OP_FUSED_ELEMENTWISE with axis_names: input 0 all-reduced first, fused with the update as
  // OP_ADAM_UPDATE's gradient is (executor_adam.cc).
  absl::StatusOr<CompiledOp> CompileFusedReduceUpdate(const v1::Op& op,
                                                      const std::vector<Tensor*>& in,
                                                      const std::vector<Tensor*>& out);
  // An OP_PSUM / OP_PMEAN of several operands (worker/combine_reductions.h): one all-reduce of
  // them side by side.
  absl::StatusOr<CompiledOp> CompileBucketReduction(const v1::Op& op, Communicator* comm,
                                                    const std::vector<Tensor*>& in,
                                                    const std::vector<Tensor*>& out);
  absl::StatusOr<Tensor*> Buffer(const v1::Op& op, const std::string& name);
  absl::StatusOr<Communicator*> CommunicatorFor(const std::string& axis_name);
  // The group over several axes, the first major (psum(x, ('i', 'j'))).
  absl::StatusOr<Communicator*> CommunicatorFor(const std::vector<std::string>& axis_names);

  v1::StepProgram program_;
  Options options_;
  std::map<std::string, Tensor> buffers_;
  std::set<std::string> written_;  // buffers an op writes
  // Inputs (no op writes them) still in their own memory, unwritten: zeroed when first used
  // (buffer(), Run) unless BindInput gives them memory or values first.
  std::set<std::string> unzeroed_;
  std::vector<Tensor*> written_buffers_;  // those that own their memory (not views)
  // Reshapes and slices that may make their output a view of their input instead of a copy: the
  // output has no other writer and the input is written only by earlier ops of the same function.
  std::set<const v1::Op*> view_ops_;
  std::set<std::string> views_;  // outputs of view ops compiled as views
  // The outputs an op may write over one of its inputs when that input is donated (an Adam
  // update's or a fused element-wise op's: the op reads element i of the input before writing
  // element i of the output, and nothing reads the input later), in program order: each output
  // with the inputs it may be written over, in order of preference; a Run writes it over the
  // first of them donated and not taken.
  std::vector<std::pair<std::string, std::vector<std::string>>> over_donated_;
  std::set<std::string> donated_;  // inputs donated for the next Run
  // Parts of concatenations computed where the concatenation puts them (its copy then does
  // nothing): before each Run, `part` becomes a view of `whole` from `byte_offset` on.
  struct Placement {
    std::string part;
    std::string whole;
    size_t byte_offset;
  };
  std::vector<Placement> placements_;
  // psum / pmean / pmax ops that reduce in their input's memory: the output becomes a view of
  // the input (which nothing reads afterwards), so no copy of the input is made first.
  std::set<const v1::Op*> reduce_in_place_;
  // The bf16 compute copies of master weights (Tensor::bf16_copy), as DeepSpeed's bf16 optimizer
  // keeps them: an Adam update whose param some OP_CONVERT of the program turns to bf16 also
  // writes its new param rounded to bf16 (`values`, shareable memory, so that a single-copy
  // update writes every member's); TakeOutput hands it out with the new param, and a later
  // step's convert of that param reads it instead of converting again (bf16_copy_converts_).
  struct Bf16Copy {
    Tensor values;
    bool written = false;  // whole, by this Run's update
  };
  std::map<std::string, Bf16Copy> bf16_copies_;  // by the update's param output
  // OP_CONVERTs f32 -> bf16 whose one-writer output nothing writes in place or hands out, of an
  // input that no op writes, or of a contiguous block of one that slices and reshapes cut out
  // (a scanned layer's weight indexed out of the stacked param, as flax's nn.scan does): the
  // output is a view of that block of the input's bf16 copy when it has one, else converted
  // into memory of its own (CompileConvertReadingCopy).
  struct CopyBlock {
    std::string root;  // the buffer that no op writes
    int64_t offset;    // of the convert's input in it, in elements
  };
  std::map<const v1::Op*, CopyBlock> bf16_copy_converts_;
  // The copy that the update writing `param_out` writes, or null.
  Bf16Copy* Bf16CopyOf(const std::string& param_out);
  std::map<std::string, v1::BufferRole> roles_;
  std::map<std::string, CompiledFunction> functions_;
  std::map<std::string, std::unique_ptr<Communicator>> communicators_;
  absl::Duration collective_time_;
  std::vector<Arrival> arrivals_;
  int adam_sweeps_ = 0;
};

// Shared by the op compilers (executor_*.cc): InvalidArgument naming the op when it has other
// than `inputs` inputs (-1: any number) or `outputs` outputs.
absl::Status OpArity(const v1::Op& op, int inputs, int outputs);
// InvalidArgument naming the op, its output's dtype and dims, and what was `expected`.
absl::Status OpOutputMismatch(const v1::Op& op, const Tensor& got, const std::string& expected);
// A convert f32 -> bf16 planned to read its input's bf16 copy (Executor::bf16_copy_converts_,
// executor_buffers.cc): y becomes a view of the copy when x has one (Tensor::bf16_copy, the
// same bits a conversion gives), else x is converted into y's own memory.
Executor::CompiledOp CompileConvertReadingCopy(const Tensor* root, int64_t offset, const Tensor* x,
                                               Tensor* y);
// The element offset in x (dims `xd`, row-major) of an OP_SLICE's result (dims `yd`) when that
// result is one contiguous block of x (the dims before its first partial one single indices,
// those after it whole); nullopt otherwise, or for another kind of op.
std::optional<int64_t> SliceBlockOffset(const v1::Op& op, const Dims& xd, const Dims& yd);
// An op that runs `k`'s kernel (k must be OK; a null kernel makes an op that does nothing).
Executor::CompiledOp FromKernel(absl::StatusOr<std::unique_ptr<Kernel>> k);
// An OP_ADAM_UPDATE's hyperparameters (its reduce_dtype aside) as core/optim takes them.
AdamWHyperParams AdamWHyperParamsOf(const v1::AdamWAttrs& attrs);
// The AdamW count of an update: the f32 step counter `step` (updates done so far, element 0)
// truncated, plus one. InvalidArgument naming the value for NaN, a negative counter or one of
// 2^62 or more (no int64 count; a C++ cast of it would be undefined).
absl::StatusOr<int64_t> AdamWCount(const Tensor& step);

}  // namespace meshrun

#endif  // MESHRUN_WORKER_EXECUTOR_H_
