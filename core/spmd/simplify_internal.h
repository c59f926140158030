// Internals shared by SimplifyProgram's passes (simplify.cc, simplify_matmul.cc): use lists
// of a per-shard program's buffers and small helpers. Not a public interface.
#ifndef MESHRUN_CORE_SPMD_SIMPLIFY_INTERNAL_H_
#define MESHRUN_CORE_SPMD_SIMPLIFY_INTERNAL_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "meshrun/v1/program.pb.h"

namespace meshrun {
namespace simplify_internal {

using Ops = google::protobuf::RepeatedPtrField<v1::Op>;

// Ops that compute their outputs from their inputs and attributes alone: no collective (every
// rank must run the same ones), no in-place update.
inline bool IsPure(const v1::Op& op) {
  if (op.kind() >= v1::OP_PSUM) return false;
  if (op.kind() == v1::OP_ADAM_UPDATE || op.kind() == v1::OP_RANDOM_INIT) return false;
  if (op.kind() == v1::OP_MATMUL && op.accumulate()) return false;
  return op.kind() != v1::OP_UNSPECIFIED;
}

// Who writes and reads each buffer, and the buffers the program's caller sees.
struct Uses {
  std::map<std::string, std::vector<int>> writers, readers;
  std::set<std::string> boundary;

  explicit Uses(const v1::ShardMapProgram& p) {
    boundary.insert(p.inputs().begin(), p.inputs().end());
    boundary.insert(p.outputs().begin(), p.outputs().end());
    const Ops& ops = p.program().functions(0).ops();
    for (int i = 0; i < ops.size(); ++i) {
      for (const std::string& out : ops.Get(i).outputs()) writers[out].push_back(i);
      for (const std::string& in : ops.Get(i).inputs()) readers[in].push_back(i);
    }
  }
  // Written by op `i` alone (or never written, an argument): its value is fixed once it exists.
  bool Fixed(const std::string& name) const {
    auto w = writers.find(name);
    return w == writers.end() || w->second.size() == 1;
  }
  int Writer(const std::string& name) const {
    auto w = writers.find(name);
    return w == writers.end() || w->second.size() != 1 ? -1 : w->second[0];
  }
  // The op that writes `name` once, where one op alone reads it and the caller does not see it
  // (a product that the reader may take into the op that computes it); -1 otherwise.
  int PrivateWriter(const std::string& name) const {
    return boundary.count(name) || NumReaders(name) != 1 ? -1 : Writer(name);
  }
  size_t NumReaders(const std::string& name) const {
    auto r = readers.find(name);
    return r == readers.end() ? 0 : r->second.size();
  }
};

inline std::map<std::string, const v1::BufferDecl*> Decls(const v1::StepProgram& program) {
  std::map<std::string, const v1::BufferDecl*> decls;
  for (const v1::BufferDecl& b : program.buffers()) decls[b.name()] = &b;
  return decls;
}

// Drops the ops marked deleted (a sweep marks them, so that its Uses' indices stay valid).
inline void Compact(Ops* ops, const std::vector<bool>& deleted) {
  Ops kept;
  for (int i = 0; i < ops->size(); ++i)
    if (!deleted[i]) *kept.Add() = std::move(*ops->Mutable(i));
  *ops = std::move(kept);
}

inline std::vector<int64_t> DimsOf(const v1::BufferDecl* b) {
  if (b == nullptr) return {};
  return std::vector<int64_t>(b->shape().dims().begin(), b->shape().dims().end());
}

// The matmul fusions (simplify_matmul.cc), each one sweep over the program.
void FoldConvertIntoMatmul(v1::ShardMapProgram* p);
void FuseMatmulBias(v1::ShardMapProgram* p);
void ReluGradFromOutput(v1::ShardMapProgram* p);
void FuseMatmulActivation(v1::ShardMapProgram* p);

}  // namespace simplify_internal
}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_SIMPLIFY_INTERNAL_H_
