#include "net/credentials.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace meshrun {
namespace fs = std::filesystem;

namespace {

struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct CertFree {
  void operator()(X509* x) const { X509_free(x); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Cert = std::unique_ptr<X509, CertFree>;

absl::Status SslError(const std::string& what) {
  return absl::InternalError(absl::StrCat("certs: ", what, " failed (OpenSSL)"));
}

// Adds extension `nid` = `value` (OpenSSL's config syntax) to `cert`, issued by `issuer`.
bool AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key` named CN=`name`, valid for 10 years, signed by `issuer_key` (itself
// when `issuer` is null), with the extensions given.
absl::StatusOr<Cert> MakeCertificate(EVP_PKEY* key, const std::string& name, X509* issuer,
                                     EVP_PKEY* issuer_key,
                                     const std::vector<std::pair<int, const char*>>& extensions) {
  Cert cert(X509_new());
  uint64_t serial = 0;
  if (!cert || RAND_bytes(reinterpret_cast<unsigned char*>(&serial), sizeof(serial)) != 1) {
    return SslError("a certificate");
  }
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set_uint64(X509_get_serialNumber(cert.get()), serial >> 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 10L * 365 * 24 * 3600);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* subject = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1, 0);
  X509_set_issuer_name(cert.get(), issuer != nullptr ? X509_get_subject_name(issuer) : subject);
  for (const auto& [nid, value] : extensions) {
    if (!AddExtension(cert.get(), issuer != nullptr ? issuer : cert.get(), nid, value)) {
      return SslError(absl::StrCat("the extension ", OBJ_nid2sn(nid), " of ", name));
    }
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) == 0)
    return SslError(absl::StrCat("signing ", name));
  return cert;
}

template <typename Write>
absl::StatusOr<std::string> ToPem(Write write) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new(BIO_s_mem()));
  if (!bio || write(bio.get()) != 1) return SslError("PEM encoding");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

absl::Status WriteFile(const fs::path& path, const std::string& data, fs::perms perms) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << data;
    if (!out) return absl::InternalError(absl::StrCat("certs: cannot write ", path.string()));
  }
  std::error_code ec;
  fs::permissions(path, perms, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("certs: cannot set permissions of ", path.string()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("credentials: cannot read ", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Puts "authorization: Bearer <token>" on every call of a channel.
class TokenPlugin : public grpc::MetadataCredentialsPlugin {
 public:
  explicit TokenPlugin(std::string token) : header_(absl::StrCat("Bearer ", token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->insert({"authorization", header_});
    return grpc::Status::OK;
  }

 private:
  const std::string header_;
};

// The coordinator's check: a verified node certificate, or the bearer token.
class TokenOrCertificate : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenOrCertificate(std::string token) : expected_(absl::StrCat("Bearer ", token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata*, OutputMetadata*) override {
    if (context->IsPeerAuthenticated()) return grpc::Status::OK;  // a certificate from the CA
    auto it = auth_metadata.find("authorization");
    if (it != auth_metadata.end() && !expected_.empty() && it->second.size() == expected_.size() &&
        CRYPTO_memcmp(it->second.data(), expected_.data(), expected_.size()) == 0) {
      return grpc::Status::OK;
    }
    return grpc::Status(
        grpc::UNAUTHENTICATED,
        it == auth_metadata.end()
            ? "no credentials: present the cluster's bearer token (MESHRUN_TLS_DIR/token) "
              "or a node certificate from its CA"
            : "the bearer token is not this cluster's");
  }

 private:
  const std::string expected_;
};

Credentials& Process() {
  static Credentials* c = [] {  // thread-safe initialisation
    absl::StatusOr<Credentials> d = DefaultClientCredentials();
    if (!d.ok()) {
      std::fprintf(stderr, "meshrun: %s; connecting without TLS\n",
                   std::string(d.status().message()).c_str());
    }
    return new Credentials(d.ok() ? *std::move(d) : Credentials::Insecure());
  }();
  return *c;
}

}  // namespace

Credentials Credentials::Insecure() {
  Credentials c;
  c.insecure = true;
  return c;
}

absl::Status InitCredentials(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "ca.pem", ec)) {
    return absl::AlreadyExistsError(
        absl::StrCat("certs: ", dir, " already holds a ca.pem; nothing was written"));
  }
  fs::create_directories(dir, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("certs: cannot create ", dir, ": ", ec.message()));
  fs::permissions(dir, fs::perms::owner_all, ec);
  Key ca_key(EVP_EC_gen("P-256")), node_key(EVP_EC_gen("P-256"));
  if (!ca_key || !node_key) return SslError("key generation");
  // A name of its own, so a certificate from another cluster's CA is told apart by name, not
  // only by its signature.
  unsigned char id[6];
  if (RAND_bytes(id, sizeof(id)) != 1) return SslError("random bytes");
  const std::string ca_name = absl::StrCat(
      "meshrun-ca-",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(id), sizeof(id))));
  absl::StatusOr<Cert> ca = MakeCertificate(ca_key.get(), ca_name, nullptr, ca_key.get(),
                                            {{NID_basic_constraints, "critical,CA:TRUE"},
                                             {NID_key_usage, "critical,keyCertSign,cRLSign"},
                                             {NID_subject_key_identifier, "hash"}});
  if (!ca.ok()) return ca.status();
  const std::string san = absl::StrCat("DNS:", kNodeName);
  absl::StatusOr<Cert> node =
      MakeCertificate(node_key.get(), kNodeName, ca->get(), ca_key.get(),
                      {{NID_basic_constraints, "critical,CA:FALSE"},
                       {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
                       {NID_ext_key_usage, "serverAuth,clientAuth"},
                       {NID_subject_alt_name, san.c_str()}});
  if (!node.ok()) return node.status();
  unsigned char token[32];
  if (RAND_bytes(token, sizeof(token)) != 1) return SslError("token generation");
  const fs::perms secret = fs::perms::owner_read | fs::perms::owner_write;
  const fs::perms open = secret | fs::perms::group_read | fs::perms::others_read;
  struct Output {
    const char* file;
    absl::StatusOr<std::string> pem;
    fs::perms perms;
  };
  Output outputs[] = {
      {"ca-key.pem", ToPem([&](BIO* b) {
         return PEM_write_bio_PrivateKey(b, ca_key.get(), nullptr, nullptr, 0, nullptr, nullptr);
       }),
       secret},
      {"node-key.pem", ToPem([&](BIO* b) {
         return PEM_write_bio_PrivateKey(b, node_key.get(), nullptr, nullptr, 0, nullptr, nullptr);
       }),
       secret},
      {"node.pem", ToPem([&](BIO* b) { return PEM_write_bio_X509(b, node->get()); }), open},
      {"token",
       absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(token), sizeof(token))) +
           "\n",
       secret},
      // Last: a directory with a ca.pem is complete.
      {"ca.pem", ToPem([&](BIO* b) { return PEM_write_bio_X509(b, ca->get()); }), open},
  };
  for (const Output& o : outputs) {
    if (!o.pem.ok()) return o.pem.status();
    if (absl::Status s = WriteFile(fs::path(dir) / o.file, *o.pem, o.perms); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Credentials> LoadCredentials(const std::string& dir) {
  Credentials c;
  c.dir = dir;
  absl::StatusOr<std::string> ca = ReadFile(fs::path(dir) / "ca.pem");
  if (!ca.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "credentials: ", dir, " has no ca.pem (make one with `meshrun certs init ", dir, "`)"));
  }
  c.ca_pem = *std::move(ca);
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "node.pem", ec)) {
    absl::StatusOr<std::string> cert = ReadFile(fs::path(dir) / "node.pem");
    absl::StatusOr<std::string> key = ReadFile(fs::path(dir) / "node-key.pem");
    if (!cert.ok()) return cert.status();
    if (!key.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("credentials: ", dir, " has node.pem but no node-key.pem"));
    }
    c.cert_pem = *std::move(cert);
    c.key_pem = *std::move(key);
  }
  if (absl::StatusOr<std::string> token = ReadFile(fs::path(dir) / "token"); token.ok()) {
    c.token = std::string(absl::StripAsciiWhitespace(*token));
  }
  return c;
}

absl::StatusOr<Credentials> NodeCredentials(const std::string& tls_dir, bool insecure) {
  if (insecure) return Credentials::Insecure();
  std::string dir = tls_dir;
  if (const char* env = std::getenv(kTlsDirEnv); dir.empty() && env != nullptr) dir = env;
  if (dir.empty()) {
    return absl::FailedPreconditionError(
        "no credentials: pass --tls_dir DIR (or set MESHRUN_TLS_DIR) with the cluster's "
        "certificates "
        "(make them with `meshrun certs init DIR`), or --insecure to run without authentication");
  }
  absl::StatusOr<Credentials> c = LoadCredentials(dir);
  if (c.ok() && !c->has_node_certificate()) {
    return absl::InvalidArgumentError(
        absl::StrCat("credentials: ", dir, " has no node.pem and node-key.pem: a node needs them"));
  }
  return c;
}

absl::StatusOr<Credentials> DefaultClientCredentials() {
  if (const char* insecure = std::getenv(kInsecureEnv);
      insecure != nullptr && std::string(insecure) == "1") {
    return Credentials::Insecure();
  }
  if (const char* dir = std::getenv(kTlsDirEnv); dir != nullptr && *dir != '\0')
    return LoadCredentials(dir);
  if (const char* home = std::getenv("HOME"); home != nullptr) {
    const fs::path dir = fs::path(home) / ".meshrun" / "tls";
    std::error_code ec;
    if (fs::exists(dir / "ca.pem", ec)) return LoadCredentials(dir.string());
  }
  return Credentials::Insecure();
}

void SetProcessCredentials(Credentials credentials) { Process() = std::move(credentials); }

const Credentials& ProcessCredentials() { return Process(); }

std::shared_ptr<grpc::ChannelCredentials> NodeChannelCredentials(const Credentials& c) {
  if (c.insecure) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = c.ca_pem;
  ssl.pem_private_key = c.key_pem;
  ssl.pem_cert_chain = c.cert_pem;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(ssl);
  if (c.token.empty()) return creds;
  return grpc::CompositeChannelCredentials(
      creds, grpc::MetadataCredentialsFromPlugin(std::make_unique<TokenPlugin>(c.token)));
}

std::shared_ptr<grpc::ServerCredentials> NodeServerCredentials(const Credentials& c,
                                                               bool require_node_certificate) {
  if (c.insecure) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      require_node_certificate ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                               : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = c.ca_pem;
  ssl.pem_key_cert_pairs.push_back({c.key_pem, c.cert_pem});
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(ssl);
  if (!require_node_certificate)
    creds->SetAuthMetadataProcessor(std::make_shared<TokenOrCertificate>(c.token));
  return creds;
}

}  // namespace meshrun
