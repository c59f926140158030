// N connected transports of one kind, for collective tests: in-process (threads as ranks), real
// gRPC (one RingService + server per rank on loopback, in this process; its messages striped over
// several streams or not), or shared memory over that gRPC set (ShmTransport: every rank on "one
// host", rings in /dev/shm).
#ifndef MESHRUN_TESTS_TESTUTIL_TRANSPORT_SET_H_
#define MESHRUN_TESTS_TESTUTIL_TRANSPORT_SET_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/collectives/transport.h"
#include "worker/grpc_transport.h"
#include "worker/shm_arena.h"

namespace meshrun::testing {

// kGrpcStriped: kGrpc with every message of 8 bytes or more striped over up to 3 streams per
// peer (GrpcStripeOptions{3, 8}), whatever TransportSetOptions::grpc_stripes says.
enum class TransportKind { kInProcess, kGrpc, kGrpcStriped, kShm };
std::string KindName(TransportKind kind);

struct TransportSetOptions {
  // kShm: bytes of each ring (small, so that tests fill rings and cut messages into fragments).
  size_t shm_ring_bytes = 8192;
  // kShm: each rank's host id (default: the same for all) and pid (default: this process's).
  std::vector<std::string> host_ids;
  std::vector<int64_t> pids;
  // kShm: ranks left with a plain GrpcTransport (no shared-memory receiver drains their rings).
  std::vector<int> bare_ranks;
  // kShm: the arena whose segments the transports reach in each other (peer_memory()); null: none.
  ShmArena* arena = nullptr;
  // kGrpc / kShm: the ring servers and streams use mutual TLS with credentials made for this
  // process (net/credentials.h), as workers do by default; false: plaintext. Either way the
  // choice becomes this process's credentials.
  bool tls = false;
  // kGrpc / kShm: how the gRPC transports stripe messages over several streams per peer.
  GrpcStripeOptions grpc_stripes;
  // How long a receive polls before it sleeps (Mailbox's `spin`).
  absl::Duration receive_spin = absl::ZeroDuration();
  // kShm: how long a drain thread sleeps unwoken (ShmTransport::Options::drain_poll). Long, so
  // that a message whose wake-up went missing fails its receive's deadline instead of arriving
  // at the next poll.
  absl::Duration shm_drain_poll = absl::Hours(1);
};

class TransportSet {
 public:
  TransportSet(TransportKind kind, int n, const TransportSetOptions& options = {});
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
