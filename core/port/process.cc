#include "core/port/process.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace meshrun {
namespace {

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// /proc/PID/stat's state letter and start time (field 22, clock ticks since boot); false if the
// process does not exist. "PID (COMM) STATE ...": COMM may hold spaces and parentheses; the
// fields after it follow the last ')'.
bool ReadStat(int64_t pid, char* state, std::string* start_time) {
  const std::string stat = ReadLine(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
  *state = fields[0].empty() ? '?' : fields[0][0];
  *start_time = fields.size() > 19 ? fields[19] : "";  // fields from STATE (3): 22 is index 19
  return true;
}

// "<boot id>/<pid namespace>/": where a pid means the same process.
std::string PidScope() {
  static const std::string* const scope = [] {
    const std::string boot = BootId();
    const std::string ns = OwnNamespace("pid");
    return new std::string(boot.empty() || ns.empty() ? "" : absl::StrCat(boot, "/", ns, "/"));
  }();
  return *scope;
}

}  // namespace

std::string BootId() { return ReadLine("/proc/sys/kernel/random/boot_id"); }

std::string OwnNamespace(const std::string& kind) {
  char buf[PATH_MAX] = {};
  const ssize_t n = readlink(("/proc/self/ns/" + kind).c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

bool ProcessAlive(int64_t pid) {
  if (pid <= 0) return true;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char state = '?';
  std::string start;
  if (!ReadStat(pid, &state, &start)) return false;
  return state != 'Z' && state != 'X';
}

std::string ProcessIdentity(int64_t pid) {
  char state = '?';
  std::string start;
  if (PidScope().empty() || !ReadStat(pid, &state, &start) || start.empty()) return "";
  return absl::StrCat(PidScope(), pid, "/", start);
}

ProcessState ObserveProcess(const std::string& identity) {
  const std::string& scope = PidScope();
  if (scope.empty() || identity.size() <= scope.size() || identity.compare(0, scope.size(), scope))
    return ProcessState::kUnknown;
  const std::vector<std::string> rest = absl::StrSplit(identity.substr(scope.size()), '/');
  int64_t pid = 0;
  if (rest.size() != 2 || !absl::SimpleAtoi(rest[0], &pid) || pid <= 0)
    return ProcessState::kUnknown;
  char state = '?';
  std::string start;
  // Another start time: the pid now names another process; the one identified has exited.
  if (!ReadStat(pid, &state, &start) || start != rest[1]) return ProcessState::kGone;
  switch (state) {
    case 'Z':
    case 'X':
      return ProcessState::kGone;
    case 'T':
      return ProcessState::kStopped;
    default:
      return ProcessState::kRunning;
  }
}

namespace {

// The N of the first "oom_kill N" line of `path`; -1 if there is none.
int64_t ReadOomKillCount(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> kv = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t n = 0;
    if (kv.size() == 2 && kv[0] == "oom_kill" && absl::SimpleAtoi(kv[1], &n)) return n;
  }
  return -1;
}

}  // namespace

OomKillWatch WatchOomKills(int64_t pid, const std::string& root) {
  std::vector<std::string> candidates;
  std::ifstream in(absl::StrCat(root, "/proc/", pid, "/cgroup"));
  std::string line;
  while (std::getline(in, line)) {
    // "<id>:<controllers>:<path>"; v2 is "0::<path>".
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const std::vector<std::string> controllers = absl::StrSplit(f[1], ',');
    if (std::find(controllers.begin(), controllers.end(), "memory") != controllers.end()) {
      candidates.insert(candidates.begin(),
                        absl::StrCat(root, "/sys/fs/cgroup/memory", f[2], "/memory.oom_control"));
    } else if (f[0] == "0" && f[1].empty()) {
      candidates.push_back(absl::StrCat(root, "/sys/fs/cgroup", f[2], "/memory.events"));
    }
  }
  if (in.is_open()) candidates.push_back(absl::StrCat(root, "/proc/vmstat"));
  for (std::string& c : candidates) {
    const int64_t n = ReadOomKillCount(c);
    if (n >= 0) return {std::move(c), n};
  }
  return {};
}

bool OomKilledSince(const OomKillWatch& watch) {
  return watch.kills >= 0 && ReadOomKillCount(watch.counter) > watch.kills;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t{1} << 46;
  return static_cast<int64_t>(pages) * page;
}

int64_t ProcessStatusBytes(int64_t pid, const std::string& field) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  const std::string prefix = field + ":";
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    // "VmHWM:\t  123456 kB"
    std::vector<absl::string_view> words = absl::StrSplit(
        absl::string_view(line).substr(prefix.size()), absl::ByAnyChar(" \t"), absl::SkipEmpty());
    int64_t kib = 0;
    if (words.size() != 2 || words[1] != "kB" || !absl::SimpleAtoi(words[0], &kib)) return -1;
    return kib * 1024;
  }
  return -1;
}

}  // namespace meshrun
