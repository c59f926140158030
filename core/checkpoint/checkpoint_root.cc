#include "core/checkpoint/checkpoint_root.h"

#include <filesystem>

#include "absl/strings/str_cat.h"

namespace meshrun {

CheckpointRoot::CheckpointRoot(const std::string& root, std::string whose)
    : root_(Resolve(root.empty() ? "/" : root)), whose_(std::move(whose)) {}

std::string CheckpointRoot::Resolve(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec || path.empty()) return "";
  const std::filesystem::path p = std::filesystem::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal().string() : p.string();
}

absl::Status CheckpointRoot::Check(const std::string& path) const {
  const std::string resolved = path.find('\0') == std::string::npos ? Resolve(path) : "";
  const std::filesystem::path rel = std::filesystem::path(resolved).lexically_relative(root_);
  if (!resolved.empty() && !rel.empty() && *rel.begin() != "..") return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "path '", path, "' is outside ", whose_, " checkpoint root ", root_, " (--checkpoint_root)"));
}

}  // namespace meshrun
