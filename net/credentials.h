// Authentication, on by default (the lesson of Ray's ShadowRay and PyTorch RPC's CVE-2024-5480:
// a training service that any process can reach must not trust it).
//
// A cluster's credentials live in one directory, made by `meshrun certs init DIR`:
//   ca.pem        the cluster's certificate authority (ECDSA P-256, self-signed)
//   ca-key.pem    its private key (0600): only `certs init` uses it; nodes need not have it
//   node.pem      the certificate every node (coordinator, worker) presents, signed by the CA,
//                 subject CN "meshrun-node", SAN DNS:meshrun-node (serverAuth and clientAuth)
//   node-key.pem  its private key (0600)
//   token         the clients' bearer token: 32 random bytes, hex
// Between nodes: mutual TLS (gRPC's SSL credentials). Every channel verifies its server's
// certificate against the CA under the name "meshrun-node" (not the dialled host, so one
// certificate serves any address), and presents the node certificate when it holds one.
// Workers require a client certificate from the cluster's CA on every RPC: only the coordinator
// and peer workers reach them. The coordinator takes either that certificate (workers
// registering, heartbeating) or the bearer token ("authorization: Bearer <token>", compared in
// constant time): anything else is refused with UNAUTHENTICATED before its handler runs.
// `--insecure` (and Credentials::Insecure) is the explicit opt-out: plaintext, no checks.
//
// Thread-safety: SetProcessCredentials before any channel or server is made (main, or the
// client's Connect); the rest is thread-safe.
#ifndef MESHRUN_NET_CREDENTIALS_H_
#define MESHRUN_NET_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"

namespace meshrun {

// The name every node's certificate carries and every channel verifies.
inline constexpr char kNodeName[] = "meshrun-node";
// The environment variable naming a credentials directory (the CLI's and SDKs' default).
inline constexpr char kTlsDirEnv[] = "MESHRUN_TLS_DIR";
// Set to 1: a client connects without TLS (to a cluster run with --insecure).
inline constexpr char kInsecureEnv[] = "MESHRUN_INSECURE";

struct Credentials {
  bool insecure = false;
  std::string dir;  // where they were loaded from, for messages
  std::string ca_pem;
  std::string cert_pem, key_pem;  // this node's; empty for a client
  std::string token;              // empty for a node that has no token file
  static Credentials Insecure();
  bool has_node_certificate() const { return !cert_pem.empty(); }
};

// Writes a new CA, node certificate and key, and token into `dir` (created, 0700; the keys and
// token 0600). Errors: AlreadyExists if `dir` already holds a ca.pem (nothing is overwritten);
// Internal naming the file or the OpenSSL step that failed.
absl::Status InitCredentials(const std::string& dir);

// Reads a credentials directory: ca.pem is required; node.pem with node-key.pem, and token, are
// each optional (a client needs the CA and the token). Errors: NotFound naming the missing
// ca.pem or directory; InvalidArgument for a node.pem without its key.
absl::StatusOr<Credentials> LoadCredentials(const std::string& dir);

// A node's (coordinator's, worker's) credentials from its flags: Insecure() with `insecure`;
// else the directory `tls_dir`, or $MESHRUN_TLS_DIR when that is empty, which must hold the node
// certificate. Errors: FailedPrecondition when neither names a directory (saying how to make one
// or opt out); those of LoadCredentials; InvalidArgument when it has no node certificate.
absl::StatusOr<Credentials> NodeCredentials(const std::string& tls_dir, bool insecure);

// Where a client finds its credentials: Insecure() if $MESHRUN_INSECURE is 1; $MESHRUN_TLS_DIR
// if set; else ~/.meshrun/tls if it holds a ca.pem (what `meshrun up` makes); else Insecure().
absl::StatusOr<Credentials> DefaultClientCredentials();

// The credentials every channel (CreateChannel) and server of this process uses. Until set:
// DefaultClientCredentials() at the first use.
void SetProcessCredentials(Credentials credentials);
const Credentials& ProcessCredentials();

// Channel credentials to a node: TLS against the CA (name "meshrun-node"), the node certificate
// when held, and the bearer token on every call when held; insecure ones with Insecure().
std::shared_ptr<grpc::ChannelCredentials> NodeChannelCredentials(const Credentials& c);

// Server credentials for the process's credentials. `require_node_certificate`: every caller
// must present a certificate from the cluster's CA (workers); otherwise a caller presents that
// certificate or the bearer token (the coordinator). Insecure ones with Insecure().
std::shared_ptr<grpc::ServerCredentials> NodeServerCredentials(const Credentials& c,
                                                               bool require_node_certificate);

}  // namespace meshrun

#endif  // MESHRUN_NET_CREDENTIALS_H_
