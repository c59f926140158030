// N connected transports of one kind, for collective tests: in-process (threads as ranks) or
// real gRPC (one RingService + server per rank on loopback, in this process).
#ifndef MESHRUN_TESTS_TESTUTIL_TRANSPORT_SET_H_
#define MESHRUN_TESTS_TESTUTIL_TRANSPORT_SET_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/collectives/transport.h"

namespace meshrun::testing {

enum class TransportKind { kInProcess, kGrpc };
std::string KindName(TransportKind kind);

class TransportSet {
 public:
  TransportSet(TransportKind kind, int n);
  ~TransportSet();
  Transport* at(int rank);
  int size() const { return n_; }
  // Runs fn(rank) on one thread per rank and joins them.
  void RunRanks(const std::function<void(int)>& fn);

 private:
  struct Impl;
  int n_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshrun::testing

#endif  // MESHRUN_TESTS_TESTUTIL_TRANSPORT_SET_H_
