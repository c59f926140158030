// Helpers for end-to-end tests that run meshrun's real binaries.
#ifndef MESHRUN_TESTS_TESTUTIL_PROCESS_UTIL_H_
#define MESHRUN_TESTS_TESTUTIL_PROCESS_UTIL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "core/port/http.h"

namespace meshrun::testing {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

// Runs `argv` (argv[0] a path) to completion, capturing its output; kills it after
// `timeout_seconds`.
CommandResult RunCommand(const std::vector<std::string>& argv, double timeout_seconds);

// True if `pid` exists (is not reaped).
bool ProcessExists(pid_t pid);

std::string ReadFile(const std::string& path);
// GET http://host:port/path over a plain socket; the body, or "" on failure.
using ::meshrun::HttpGet;
std::string WriteTempFile(const std::string& name, const std::string& contents);

}  // namespace meshrun::testing

#endif  // MESHRUN_TESTS_TESTUTIL_PROCESS_UTIL_H_
