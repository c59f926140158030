#include "core/config/flag_checks.h"

#include "absl/strings/str_cat.h"

namespace meshrun {

absl::Status CheckFlagRange(absl::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " ", value, " is out of range; expected ", lo, "..", hi));
}

absl::Status CheckFlagPositive(absl::string_view flag, absl::Duration value) {
  if (value > absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " ", absl::FormatDuration(value), " must be positive"));
}

absl::Status CheckFlagRange(absl::string_view flag, absl::Duration value, absl::Duration lo,
                            absl::Duration hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " ", absl::FormatDuration(value), " is out of range; expected ",
                   absl::FormatDuration(lo), "..", absl::FormatDuration(hi)));
}

absl::Status FirstFailed(std::initializer_list<absl::Status> checks) {
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace meshrun
