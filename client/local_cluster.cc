#include "meshrun/local_cluster.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/port/process.h"
#include "core/sharding/mesh.h"
#include "meshrun/client.h"
#include "net/credentials.h"

namespace meshrun {
namespace {

// fork + exec with stdout/stderr to `log_path`; the child dies with its parent. With `netns`
// set, the child joins that network namespace (/run/netns/NAME) first, as `ip netns exec` does.
absl::StatusOr<pid_t> Spawn(const std::string& binary, const std::vector<std::string>& args,
                            const std::string& log_path,
                            const std::vector<std::pair<std::string, std::string>>& env = {},
                            bool append_log = false, const std::string& netns = "") {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("executable ", binary, " not found (build meshrun first)"));
  }
  int netns_fd = -1;
  if (!netns.empty()) {
    const std::string path = "/run/netns/" + netns;
    netns_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (netns_fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("network namespace ", netns, ": cannot open ", path, ": ", strerror(errno)));
    }
  }
  std::vector<std::string> argv_storage = {binary};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    if (netns_fd >= 0) close(netns_fd);
    return absl::InternalError(absl::StrCat("fork failed for ", binary));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) _exit(126);
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | (append_log ? O_APPEND : O_TRUNC), 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), /*overwrite=*/0);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  if (netns_fd >= 0) close(netns_fd);
  return pid;
}

// Waits up to `timeout` for `pid` to exit; true once reaped.
bool WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// The directory of the credentials this process made for its local clusters (once).
absl::StatusOr<std::string> OwnCredentialsDir() {
  static absl::Mutex mu(absl::kConstInit);
  static std::string* dir = nullptr;
  absl::MutexLock lock(&mu);
  if (dir != nullptr) return *dir;
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp ? tmp : "/tmp", "/meshrun-tls-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr)
    return absl::InternalError("cannot create a credentials directory");
  const std::string made = templ + "/tls";
  if (absl::Status s = InitCredentials(made); !s.ok()) return s;
  dir = new std::string(made);
  return *dir;
}

// The processes' credential flag; makes their credentials this process's, to reach them.
absl::StatusOr<std::string> CredentialFlag(const LocalClusterOptions& o, std::string* tls_dir) {
  if (o.insecure) {
    SetProcessCredentials(Credentials::Insecure());
    setenv(kInsecureEnv, "1", 1);
    return std::string("--insecure");
  }
  absl::StatusOr<std::string> dir = o.tls_dir;
  if (o.tls_dir.empty()) dir = OwnCredentialsDir();
  if (!dir.ok()) return dir.status();
  absl::StatusOr<Credentials> creds = NodeCredentials(*dir, false);
  if (!creds.ok()) return creds.status();
  SetProcessCredentials(*std::move(creds));
  // So do the programs this process starts (the CLI, say).
  setenv(kTlsDirEnv, dir->c_str(), 1);
  unsetenv(kInsecureEnv);
  *tls_dir = *dir;
  return absl::StrCat("--tls_dir=", *dir);
}

}  // namespace

std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

namespace {

// The last non-empty line of a process's log: where a process that exits at start says why.
std::string LastLogLine(const std::string& path) {
  std::ifstream in(path);
  std::string last;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) last = std::move(line);
  }
  return last;
}

// `log_dir`, created if missing, or a fresh directory under $TMPDIR (/tmp) when it is empty.
absl::StatusOr<std::string> MakeLogDir(const std::string& log_dir) {
  if (!log_dir.empty()) {
    mkdir(log_dir.c_str(), 0755);
    return log_dir;
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp ? tmp : "/tmp", "/meshrun-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) return absl::InternalError("cannot create a log directory");
  return templ;
}

}  // namespace

absl::Status LocalCluster::StartCoordinator(const LocalClusterOptions& o,
                                            const std::string& credential_flag,
                                            absl::Time deadline) {
  const std::string port_file = log_dir_ + "/coordinator.port";
  std::remove(port_file.c_str());
  coordinator_args_ = {
      absl::StrCat("--port=", o.port),
      absl::StrCat("--mesh=", o.mesh),
      absl::StrCat("--port_file=", port_file),
      absl::StrCat("--heartbeat_timeout=", absl::FormatDuration(o.heartbeat_timeout)),
      absl::StrCat("--client_lease=", absl::FormatDuration(o.client_lease)),
      absl::StrCat("--process_checks=", o.process_checks ? "true" : "false"),
      absl::StrCat("--state_file=", log_dir_, "/coordinator-state.json"),
      absl::StrCat("--host=", o.coordinator_host),
      absl::StrCat("--checkpoint_root=", o.checkpoint_root),
      credential_flag};
  absl::StatusOr<pid_t> coord =
      Spawn(coordinator_binary_, coordinator_args_, log_dir_ + "/coordinator.log");
  if (!coord.ok()) return coord.status();
  coordinator_pid_ = *coord;
  int port = 0;
  while (port == 0) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    if (port != 0) break;
    int status;
    if (waitpid(coordinator_pid_, &status, WNOHANG) == coordinator_pid_) {
      coordinator_pid_ = -1;
      const std::string log = log_dir_ + "/coordinator.log";
      return absl::UnavailableError(
          absl::StrCat("coordinator exited at start (", LastLogLine(log), "); see ", log));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("coordinator did not start; see ", log_dir_));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  address_ = absl::StrCat(o.coordinator_host, ":", port);
  coordinator_args_[0] = absl::StrCat("--port=", port);  // a restart binds the same one
  return absl::OkStatus();
}

absl::Status LocalCluster::StartWorkers(const LocalClusterOptions& o, int workers,
                                        const std::string& credential_flag) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.compute_threads > 0 ? o.compute_threads : std::max(1, cores / workers);
  // When each worker's compute threads have cores to themselves, let OpenMP threads spin between
  // the step's many small primitives instead of sleeping (1.7x samples/s for one 2-thread
  // worker); the finite spin count lets an idle worker sleep after about 20 ms.
  if (threads > 1 && threads * workers <= cores)
    worker_env_ = {{"OMP_WAIT_POLICY", "ACTIVE"}, {"GOMP_SPINCOUNT", "20000000"}};
  for (int r = 0; r < workers; ++r) {
    worker_args_.push_back(
        {absl::StrCat("--coordinator=", address_), absl::StrCat("--compute_threads=", threads),
         absl::StrCat("--join_timeout=", absl::FormatDuration(o.start_timeout)),
         absl::StrCat("--shm_transport=", o.shm_transport ? "true" : "false"),
         absl::StrCat("--memory_budget_bytes=", o.worker_memory_budget_bytes),
         absl::StrCat("--checkpoint_root=", o.checkpoint_root), credential_flag});
    if (!worker_netns_.empty())
      worker_args_.back().push_back(absl::StrCat("--host=", o.worker_hosts[r]));
    for (const std::string& flag : o.worker_flags) worker_args_.back().push_back(flag);
    absl::StatusOr<pid_t> w =
        Spawn(worker_binary_, worker_args_.back(), absl::StrCat(log_dir_, "/worker", r, ".log"),
              worker_env_, false, WorkerNetns(r));
    if (!w.ok()) return w.status();
    absl::MutexLock lock(&mu_);
    worker_pids_.push_back(*w);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const LocalClusterOptions& o) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse(o.mesh);
  if (!mesh.ok()) return mesh.status();
  const int workers = mesh->size();
  if (!o.worker_netns.empty() && (static_cast<int>(o.worker_netns.size()) != workers ||
                                  o.worker_hosts.size() != o.worker_netns.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.worker_netns.size(), " network namespaces and ", o.worker_hosts.size(),
        " worker hosts for a mesh of ", workers, " devices; expected one of each per worker"));
  }
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  const std::string bin = o.bin_dir.empty() ? ExecutableDir() : o.bin_dir;
  c->coordinator_binary_ = bin + "/meshrun-coordinator";
  c->worker_binary_ = bin + "/meshrun-worker";
  c->worker_netns_ = o.worker_netns;
  absl::StatusOr<std::string> log_dir = MakeLogDir(o.log_dir);
  if (!log_dir.ok()) return log_dir.status();
  c->log_dir_ = *log_dir;
  absl::StatusOr<std::string> credential_flag = CredentialFlag(o, &c->tls_dir_);
  if (!credential_flag.ok()) return credential_flag.status();
  const absl::Time deadline = absl::Now() + o.start_timeout;
  if (absl::Status s = c->StartCoordinator(o, *credential_flag, deadline); !s.ok()) return s;
  if (absl::Status s = c->StartWorkers(o, workers, *credential_flag); !s.ok()) return s;
  if (o.respawn_workers) {
    absl::MutexLock lock(&c->mu_);
    c->supervising_ = true;
    c->supervisor_ = std::thread([cluster = c.get()] { cluster->Supervise(); });
  }
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(c->address_, deadline - absl::Now());
  if (!client.ok()) return client.status();
  if (absl::Status s = (*client)->WaitForWorkers(deadline - absl::Now()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "; logs in ", c->log_dir_));
  }
  return c;
}

LocalCluster::~LocalCluster() { Stop().IgnoreError(); }

std::vector<pid_t> LocalCluster::worker_pids() const {
  absl::MutexLock lock(&mu_);
  return worker_pids_;
}

int LocalCluster::respawns() const {
  absl::MutexLock lock(&mu_);
  return respawns_;
}

void LocalCluster::Supervise() {
  std::vector<absl::Time> last_start(worker_args_.size(), absl::Now());
  std::vector<bool> finished(worker_args_.size(), false);  // exited 0: asked to stop
  absl::MutexLock lock(&mu_);
  while (supervising_) {
    for (size_t i = 0; i < worker_pids_.size(); ++i) {
      int status = 0;
      if (finished[i] || waitpid(worker_pids_[i], &status, WNOHANG) != worker_pids_[i]) continue;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        finished[i] = true;  // asked to stop: not a failure
        continue;
      }
      // At most one start per 500 ms: a worker that cannot start does not spin.
      mu_.Unlock();
      absl::SleepFor(
          std::max(absl::ZeroDuration(), last_start[i] + absl::Milliseconds(500) - absl::Now()));
      mu_.Lock();
      if (!supervising_) break;
      last_start[i] = absl::Now();
      absl::StatusOr<pid_t> w =
          Spawn(worker_binary_, worker_args_[i], absl::StrCat(log_dir_, "/worker", i, ".log"),
                worker_env_, /*append_log=*/true, WorkerNetns(static_cast<int>(i)));
      if (!w.ok()) {
        finished[i] = true;  // the binary is gone: nothing to respawn
        continue;
      }
      worker_pids_[i] = *w;
      ++respawns_;
    }
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](bool* supervising) { return !*supervising; }, &supervising_),
                         absl::Milliseconds(50));
  }
}

absl::Status LocalCluster::RestartCoordinator() {
  if (coordinator_pid_ > 0) {
    kill(coordinator_pid_, SIGKILL);
    WaitExit(coordinator_pid_, absl::Seconds(5));
  }
  absl::StatusOr<pid_t> coord =
      Spawn(coordinator_binary_, coordinator_args_, log_dir_ + "/coordinator-restarted.log");
  if (!coord.ok()) return coord.status();
  coordinator_pid_ = *coord;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address_, absl::Seconds(30));
  if (!client.ok()) {
    return absl::UnavailableError(absl::StrCat("the restarted coordinator does not serve on ",
                                               address_, ": ", client.status().message()));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::Stop(absl::Duration grace) {
  if (stopped_) return absl::OkStatus();
  stopped_ = true;
  {
    absl::MutexLock lock(&mu_);
    supervising_ = false;
  }
  if (supervisor_.joinable()) supervisor_.join();
  // A coordinator already gone (a `meshrun shutdown`) is not waited for in a connect.
  if (!address_.empty() && ProcessAlive(coordinator_pid_)) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address_, absl::Seconds(1));
    if (client.ok()) (*client)->Shutdown().IgnoreError();
  }
  std::vector<pid_t> all = worker_pids();
  if (coordinator_pid_ > 0) all.push_back(coordinator_pid_);
  const absl::Time deadline = absl::Now() + grace;
  std::vector<pid_t> left;
  for (pid_t p : all) {
    if (!WaitExit(p, std::max(absl::ZeroDuration(), deadline - absl::Now()))) left.push_back(p);
  }
  for (pid_t p : left) kill(p, SIGTERM);
  std::vector<pid_t> stubborn;
  for (pid_t p : left) {
    if (!WaitExit(p, absl::Seconds(2))) stubborn.push_back(p);
  }
  for (pid_t p : stubborn) {
    kill(p, SIGKILL);
    WaitExit(p, absl::Seconds(5));
  }
  return absl::OkStatus();
}

}  // namespace meshrun
