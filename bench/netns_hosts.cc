#include "bench/netns_hosts.h"

#include <unistd.h>

#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

// Runs `command` through the shell. FailedPrecondition naming it, with what it printed, on
// failure (e.g. "Specified qdisc kind is unknown." where the kernel has no sch_netem).
absl::Status Run(const std::string& command) {
  FILE* out = popen((command + " 2>&1").c_str(), "r");
  if (out == nullptr)
    return absl::FailedPreconditionError(absl::StrCat("cannot run `", command, "`"));
  std::string printed;
  char buf[256];
  while (std::fgets(buf, sizeof(buf), out) != nullptr) printed += buf;
  const int rc = pclose(out);
  if (rc == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "`", command, "` failed (status ", rc, "): ", absl::StripTrailingAsciiWhitespace(printed)));
}

bool Have(const std::string& tool) { return Run("command -v " + tool).ok(); }

}  // namespace

absl::StatusOr<std::unique_ptr<NetnsHosts>> NetnsHosts::Create(int n, absl::Duration delay) {
  if (geteuid() != 0) {
    return absl::PermissionDeniedError(
        "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)");
  }
  if (!Have("ip")) return absl::FailedPreconditionError("network namespaces need iproute2's `ip`");
  if (delay > absl::ZeroDuration() && !Have("tc")) {
    return absl::FailedPreconditionError("a netem delay needs iproute2's `tc`");
  }
  const int tag = static_cast<int>(getpid() % 100000);
  const std::string net = absl::StrCat("10.214.", getpid() % 250, ".");
  std::unique_ptr<NetnsHosts> h(new NetnsHosts());
  h->bridge_ = absl::StrCat("mrbb", tag);
  h->bridge_address_ = net + "1";
  if (absl::Status s = Run(absl::StrCat("ip link add ", h->bridge_, " type bridge")); !s.ok()) {
    h->bridge_.clear();  // not ours to delete
    return s;
  }
  // A Docker engine sets the FORWARD policy to DROP, which bridged traffic meets when br_netfilter
  // is loaded: let this bridge forward between its own ports.
  h->forward_rule_ =
      Run(absl::StrCat("iptables -I FORWARD -i ", h->bridge_, " -o ", h->bridge_, " -j ACCEPT"))
          .ok();
  for (const std::string& c :
       {absl::StrCat("ip addr add ", h->bridge_address_, "/24 dev ", h->bridge_),
        absl::StrCat("ip link set ", h->bridge_, " up")}) {
    if (absl::Status s = Run(c); !s.ok()) return s;
  }
  for (int i = 0; i < n; ++i) {
    const std::string ns = absl::StrCat("mrbn", tag, "-", i);
    const std::string host_end = absl::StrCat("mrbh", tag, "-", i);
    const std::string ns_end = absl::StrCat("mrbw", tag, "-", i);
    const std::string address = absl::StrCat(net, 10 + i);
    if (absl::Status s = Run("ip netns add " + ns); !s.ok()) return s;
    h->namespaces_.push_back(ns);
    h->host_links_.push_back(host_end);
    h->addresses_.push_back(address);
    const std::string in_ns = "ip netns exec " + ns + " ";
    std::vector<std::string> commands = {
        absl::StrCat("ip link add ", host_end, " type veth peer name ", ns_end),
        absl::StrCat("ip link set ", host_end, " master ", h->bridge_, " up"),
        absl::StrCat("ip link set ", ns_end, " netns ", ns),
        absl::StrCat(in_ns, "ip addr add ", address, "/24 dev ", ns_end),
        absl::StrCat(in_ns, "ip link set ", ns_end, " up"),
        absl::StrCat(in_ns, "ip link set lo up")};
    if (delay > absl::ZeroDuration()) {
      commands.push_back(absl::StrCat(in_ns, "tc qdisc add dev ", ns_end, " root netem delay ",
                                      absl::ToInt64Microseconds(delay), "us"));
    }
    for (const std::string& c : commands) {
      if (absl::Status s = Run(c); !s.ok()) return s;
    }
  }
  return h;
}

NetnsHosts::~NetnsHosts() {
  // Each pair goes first, by its host end: deleting a namespace deletes its veth end, and with it
  // the pair, only when the kernel's namespace clean-up gets to it (later, under load).
  for (const std::string& link : host_links_) Run("ip link del " + link).IgnoreError();
  for (const std::string& ns : namespaces_) Run("ip netns del " + ns).IgnoreError();
  if (bridge_.empty()) return;
  Run("ip link del " + bridge_).IgnoreError();
  if (forward_rule_) {
    Run(absl::StrCat("iptables -D FORWARD -i ", bridge_, " -o ", bridge_, " -j ACCEPT"))
        .IgnoreError();
  }
}

}  // namespace meshrun
