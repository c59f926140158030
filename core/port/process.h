// Operating-system facts about other processes on this host (Linux /proc), as LevelDB keeps its
// platform code in port/.
#ifndef MESHRUN_CORE_PORT_PROCESS_H_
#define MESHRUN_CORE_PORT_PROCESS_H_

#include <cstdint>
#include <string>

namespace meshrun {

// Whether process `pid` on this host is alive: it exists and is neither a zombie (exited, not yet
// reaped by its parent) nor dead. A pid <= 0 (unknown) counts as alive, so callers fall back on
// their deadlines. Thread-safe; reads /proc/PID/stat.
bool ProcessAlive(int64_t pid);

// This boot of this host (/proc/sys/kernel/random/boot_id); "" if unreadable.
std::string BootId();

// This process's namespace of `kind` ("pid", "net"): "pid:[4026531836]"; "" if unreadable.
std::string OwnNamespace(const std::string& kind);

// Names process `pid` of this host beyond its pid: "<boot id>/<pid namespace>/<pid>/<start
// time>", so that another process can tell with ObserveProcess whether it sees that very process
// (not one that reused the pid, not one in another pid namespace or on another host). "" if /proc
// cannot be read. Thread-safe.
std::string ProcessIdentity(int64_t pid);

enum class ProcessState {
  kUnknown,  // not observable from here: another host or pid namespace, or no identity
  kRunning,  // running or sleeping (a debugger's tracing stop included)
  kStopped,  // stopped by a signal (SIGSTOP, SIGTSTP: 'T' in /proc/PID/stat)
  kGone,     // exited (a zombie not yet reaped included), its pid free or reused
};

// The state of the process that `identity` (ProcessIdentity, taken by that process or another
// in the same pid namespace) names, as this process sees it. Thread-safe; reads /proc.
ProcessState ObserveProcess(const std::string& identity);

// The kernel's count of OOM kills that a process would be among, read while it runs so that,
// once it is gone, a count that grew says the OOM killer (any kind: a cgroup limit or the whole
// host) ended it or a process beside it in its memory cgroup. `counter`: the file counting them,
// as this process sees it: cgroup v2 /sys/fs/cgroup/<path>/memory.events, v1
// /sys/fs/cgroup/memory/<path>/memory.oom_control (its "oom_kill N" line, Linux >= 4.13), else
// the host's /proc/vmstat; `kills` -1 when none is readable.
struct OomKillWatch {
  std::string counter;
  int64_t kills = -1;
};
// `root` (tests): where /proc and /sys are, "" for the real ones. Thread-safe.
OomKillWatch WatchOomKills(int64_t pid, const std::string& root = "");
// Whether the count of `watch` grew since it was taken (false when unreadable).
bool OomKilledSince(const OomKillWatch& watch);

// This host's physical memory in bytes (sysconf), or 2^46 if it cannot be read.
int64_t PhysicalMemoryBytes();

// A memory field of /proc/PID/status in bytes: "VmRSS" (the resident set), "VmHWM" (its peak
// since start or since "5" was written to /proc/PID/clear_refs), "VmSize"... -1 if the process
// or the field cannot be read. Thread-safe.
int64_t ProcessStatusBytes(int64_t pid, const std::string& field);

}  // namespace meshrun

#endif  // MESHRUN_CORE_PORT_PROCESS_H_
