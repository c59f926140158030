// Client leases: the arrays a client creates belong to its session (the "meshrun-session" gRPC
// metadata every SDK call carries), which lives while the client calls or sends KeepAlive; a
// session silent for the lease is expired and its arrays are freed, so a client that dies or
// loses its connection leaves nothing on the workers. Arrays made without a session (the CLI,
// older clients) belong to no one and stay until deleted.
#ifndef MESHRUN_SERVER_CLIENT_LEASES_H_
#define MESHRUN_SERVER_CLIENT_LEASES_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "net/grpc_util.h"

namespace meshrun {

// The session a call carries ("" when none): metadata kSessionMetadataKey (net/grpc_util.h).
std::string SessionOf(const grpc::ServerContextBase& ctx);

// Thread-safe.
class ClientLeases {
 public:
  explicit ClientLeases(absl::Duration lease) : lease_(lease) {}
  absl::Duration lease() const { return lease_; }

  // The session called now (no-op for "").
  void Touch(const std::string& session);
  // `array_id` (just created by `session`) belongs to it; no-op for "".
  void Own(const std::string& session, const std::string& array_id);
  // `array_id` was deleted (by anyone).
  void Disown(const std::string& array_id);
  struct Expired {
    std::string session;
    std::vector<std::string> arrays;
  };
  // The sessions silent for longer than the lease at `now`, removed, with the arrays they owned.
  std::vector<Expired> Expire(absl::Time now);
  // How many arrays `session` owns.
  int OwnedCount(const std::string& session);
  // The owner of `array_id` ("" if none).
  std::string Owner(const std::string& array_id);

 private:
  const absl::Duration lease_;
  absl::Mutex mu_;
  std::map<std::string, absl::Time> last_seen_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<std::string>> owned_ ABSL_GUARDED_BY(mu_);  // session -> ids
  std::map<std::string, std::string> owner_ ABSL_GUARDED_BY(mu_);            // id -> session
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_CLIENT_LEASES_H_
