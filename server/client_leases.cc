#include "server/client_leases.h"

#include <algorithm>

namespace meshrun {

std::string SessionOf(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kSessionMetadataKey);
  if (it == md.end()) return "";
  return std::string(it->second.data(), std::min<size_t>(it->second.size(), 128));
}

void ClientLeases::Touch(const std::string& session) {
  if (session.empty()) return;
  absl::MutexLock lock(&mu_);
  last_seen_[session] = absl::Now();
}

void ClientLeases::Own(const std::string& session, const std::string& array_id) {
  if (session.empty() || array_id.empty()) return;
  absl::MutexLock lock(&mu_);
  last_seen_[session] = absl::Now();
  auto previous = owner_.find(array_id);
  if (previous != owner_.end()) owned_[previous->second].erase(array_id);
  owner_[array_id] = session;
  owned_[session].insert(array_id);
}

void ClientLeases::Disown(const std::string& array_id) {
  absl::MutexLock lock(&mu_);
  auto it = owner_.find(array_id);
  if (it == owner_.end()) return;
  owned_[it->second].erase(array_id);
  owner_.erase(it);
}

int ClientLeases::OwnedCount(const std::string& session) {
  absl::MutexLock lock(&mu_);
  auto it = owned_.find(session);
  return it == owned_.end() ? 0 : static_cast<int>(it->second.size());
}

std::string ClientLeases::Owner(const std::string& array_id) {
  absl::MutexLock lock(&mu_);
  auto it = owner_.find(array_id);
  return it == owner_.end() ? "" : it->second;
}

std::vector<ClientLeases::Expired> ClientLeases::Expire(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<Expired> out;
  for (auto it = last_seen_.begin(); it != last_seen_.end();) {
    if (now - it->second <= lease_) {
      ++it;
      continue;
    }
    Expired e{it->first, {}};
    for (const std::string& id : owned_[it->first]) {
      e.arrays.push_back(id);
      owner_.erase(id);
    }
    owned_.erase(it->first);
    out.push_back(std::move(e));
    it = last_seen_.erase(it);
  }
  return out;
}

}  // namespace meshrun
