// Hosts of their own on this machine, for benchmarks between "hosts": N network namespaces, each
// joined by a veth pair to one bridge in this namespace (as tests/e2e/netns_test.sh builds
// them), so traffic between workers crosses a real network stack per host (veth, bridge, the
// namespace's own TCP) instead of loopback; `tc netem` can delay every packet each namespace
// sends, to show latency-bound behaviour as a network with that one-way delay would.
#ifndef MESHRUN_BENCH_NETNS_HOSTS_H_
#define MESHRUN_BENCH_NETNS_HOSTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace meshrun {

class NetnsHosts {
 public:
  // Creates `n` namespaces on a private /24 (10.214.X.0/24, X from this process's pid), with
  // `delay` of netem on each namespace's link (zero: none). Errors: PermissionDenied without
  // root; FailedPrecondition when `ip` or (with a delay) `tc` is missing or a command fails,
  // naming it. Everything made is removed when creation fails and by the destructor.
  static absl::StatusOr<std::unique_ptr<NetnsHosts>> Create(int n, absl::Duration delay);
  ~NetnsHosts();
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  // The bridge's address in this namespace: every namespace reaches it (the coordinator's host).
  const std::string& bridge_address() const { return bridge_address_; }
  // Per namespace: its name (under /run/netns) and its address on the bridge.
  const std::vector<std::string>& namespaces() const { return namespaces_; }
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  NetnsHosts() = default;
  std::string bridge_;
  std::string bridge_address_;
  bool forward_rule_ = false;
  std::vector<std::string> namespaces_;
  std::vector<std::string> host_links_;  // the host ends of the namespaces' veth pairs
  std::vector<std::string> addresses_;
};

}  // namespace meshrun

#endif  // MESHRUN_BENCH_NETNS_HOSTS_H_
