#include "worker/peer_state.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

int64_t CopyBytes(const v1::PeerStateCopy& c) {
  int64_t n = 0;
  for (const v1::PeerStateBlock& b : c.blocks()) n += static_cast<int64_t>(b.block().data().size());
  return n;
}

}  // namespace

bool SamePeerStateKey(const v1::PeerStateKey& a, const v1::PeerStateKey& b) {
  return a.job() == b.job() && a.step() == b.step() && a.owner_rank() == b.owner_rank() &&
         a.mesh() == b.mesh();
}

std::string DescribePeerStateKey(const v1::PeerStateKey& key) {
  return absl::StrCat("job '", key.job(), "' step ", key.step(), " of rank ", key.owner_rank(),
                      " on mesh ", key.mesh());
}

void PeerStateStore::Add(const v1::PeerStateKey& key, v1::PeerStateBlock block) {
  absl::MutexLock lock(&mu_);
  v1::PeerStateCopy& p = pending_[key.owner_rank()];
  if (!SamePeerStateKey(p.key(), key)) {
    p.Clear();
    *p.mutable_key() = key;
  }
  *p.add_blocks() = std::move(block);
}

absl::Status PeerStateStore::Commit(const v1::PeerStateKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(key.owner_rank());
  if (it == pending_.end() || !SamePeerStateKey(it->second.key(), key)) {
    return absl::FailedPreconditionError(
        absl::StrCat("no copy of ", DescribePeerStateKey(key), " is pending to commit"));
  }
  HoldLocked(std::move(it->second));
  pending_.erase(it);
  for (auto* copies : {&held_, &previous_}) {
    for (auto h = copies->begin(); h != copies->end();) {
      h = h->second.key().job() == key.job() ? std::next(h) : copies->erase(h);
    }
  }
  return absl::OkStatus();
}

v1::PeerStateInfoResponse PeerStateStore::Info() {
  absl::MutexLock lock(&mu_);
  v1::PeerStateInfoResponse info;
  for (const auto* copies : {&held_, &previous_}) {
    for (const auto& [owner, copy] : *copies) {
      v1::PeerStateInfoResponse::Held* h = info.add_held();
      *h->mutable_key() = copy.key();
      for (const v1::PeerStateBlock& b : copy.blocks()) h->add_names(b.name());
    }
  }
  return info;
}

absl::StatusOr<v1::PeerStateBlock> PeerStateStore::Find(const v1::PeerStateKey& key,
                                                        const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key.owner_rank());
  if (it != held_.end() && !SamePeerStateKey(it->second.key(), key)) {
    auto before = previous_.find(key.owner_rank());
    if (before != previous_.end() && SamePeerStateKey(before->second.key(), key)) it = before;
  }
  if (it == held_.end() || !SamePeerStateKey(it->second.key(), key)) {
    return absl::NotFoundError(absl::StrCat(
        "no copy of ", DescribePeerStateKey(key), " is held here",
        it == held_.end() ? ""
                          : absl::StrCat(" (only ", DescribePeerStateKey(it->second.key()), ")")));
  }
  for (const v1::PeerStateBlock& b : it->second.blocks()) {
    if (b.name() == name) return b;
  }
  return absl::NotFoundError(
      absl::StrCat("the copy of ", DescribePeerStateKey(key), " has no array ", name));
}

void PeerStateStore::HoldLocked(v1::PeerStateCopy copy) {
  const int owner = copy.key().owner_rank();
  auto it = held_.find(owner);
  if (it != held_.end()) previous_[owner] = std::move(it->second);
  held_[owner] = std::move(copy);
}

int64_t PeerStateStore::Drop(const std::string& job) {
  absl::MutexLock lock(&mu_);
  int64_t freed = 0;
  for (auto* copies : {&held_, &previous_, &pending_}) {
    for (auto it = copies->begin(); it != copies->end();) {
      if (it->second.key().job() != job) {
        ++it;
        continue;
      }
      freed += CopyBytes(it->second);
      it = copies->erase(it);
    }
  }
  return freed;
}

int64_t PeerStateStore::bytes() {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [owner, copy] : held_) n += CopyBytes(copy);
  for (const auto& [owner, copy] : previous_) n += CopyBytes(copy);
  for (const auto& [owner, copy] : pending_) n += CopyBytes(copy);
  return n;
}

absl::Status PeerStateStore::ExportForExec() {
  v1::PeerStateCopies all;
  {
    absl::MutexLock lock(&mu_);
    if (held_.empty()) return absl::OkStatus();
    // The previous copies first: ImportAfterExec holds them in this order.
    for (const auto& [owner, copy] : previous_) *all.add_copies() = copy;
    for (const auto& [owner, copy] : held_) *all.add_copies() = copy;
  }
  const std::string bytes = all.SerializeAsString();
  const int fd = memfd_create("meshrun-peer-state", 0);  // not close-on-exec: it outlives exec
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      close(fd);
      return absl::InternalError(absl::StrCat("writing the peer state copies to a memfd: ", why));
    }
    done += static_cast<size_t>(n);
  }
  setenv(kPeerStateFdEnv, std::to_string(fd).c_str(), 1);
  return absl::OkStatus();
}

absl::Status PeerStateStore::ImportAfterExec() {
  const char* env = std::getenv(kPeerStateFdEnv);
  if (env == nullptr) return absl::OkStatus();
  int fd = -1;
  const bool named = absl::SimpleAtoi(env, &fd) && fd >= 0;
  unsetenv(kPeerStateFdEnv);
  if (!named) {
    return absl::DataLossError(
        absl::StrCat(kPeerStateFdEnv, "='", env, "' does not name a file descriptor"));
  }
  std::string bytes;
  char buf[1 << 16];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buf, sizeof buf, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      close(fd);
      return absl::DataLossError(absl::StrCat("reading the peer state memfd ", fd, ": ", why));
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<size_t>(n));
    at += n;
  }
  close(fd);
  v1::PeerStateCopies all;
  if (!all.ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrCat("the peer state copies passed over exec (",
                                            bytes.size(), " bytes) do not parse"));
  }
  absl::MutexLock lock(&mu_);
  for (v1::PeerStateCopy& c : *all.mutable_copies()) HoldLocked(std::move(c));
  return absl::OkStatus();
}

}  // namespace meshrun
