#include "tests/testutil/process_util.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace meshrun::testing {

CommandResult RunCommand(const std::vector<std::string>& argv, double timeout_seconds) {
  CommandResult result;
  const std::string out_path = ::testing::TempDir() + "/cmd-" + std::to_string(getpid()) + ".out";
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = freopen(out_path.c_str(), "w", stdout);
    (void)f;
    dup2(1, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  while (true) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_seconds) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    usleep(20000);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.output = ReadFile(out_path);
  return result;
}

bool ProcessExists(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

std::string HttpGet(const std::string& host_port, const std::string& path) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return "";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host_port.substr(0, colon).c_str(), host_port.substr(colon + 1).c_str(), &hints, &res) != 0) return "";
  int fd = socket(res->ai_family, res->ai_socktype, 0);
  if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    freeaddrinfo(res);
    if (fd >= 0) close(fd);
    return "";
  }
  freeaddrinfo(res);
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
  if (write(fd, req.data(), req.size()) < 0) {
    close(fd);
    return "";
  }
  std::string response;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string WriteTempFile(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << contents;
  return path;
}

}  // namespace meshrun::testing
