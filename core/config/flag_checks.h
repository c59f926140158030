// Range checks for the servers' command-line flags, with the flag named in the error, as job
// config keys are checked (job_config.h). The meshrun CLI checks its flags with CLI11's
// validators instead.
#ifndef MESHRUN_CORE_CONFIG_FLAG_CHECKS_H_
#define MESHRUN_CORE_CONFIG_FLAG_CHECKS_H_

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace meshrun {

// InvalidArgument "--port 70000 is out of range; expected 0..65535" unless lo <= value <= hi.
absl::Status CheckFlagRange(absl::string_view flag, int64_t value, int64_t lo, int64_t hi);
// The same for a duration flag ("--shm_receive_spin 2s is out of range; expected 0..1s").
absl::Status CheckFlagRange(absl::string_view flag, absl::Duration value, absl::Duration lo,
                            absl::Duration hi);
// InvalidArgument "--heartbeat_timeout -1s must be positive" unless value > 0.
absl::Status CheckFlagPositive(absl::string_view flag, absl::Duration value);
// The first of `checks` that failed, or OK.
absl::Status FirstFailed(std::initializer_list<absl::Status> checks);

}  // namespace meshrun

#endif  // MESHRUN_CORE_CONFIG_FLAG_CHECKS_H_
