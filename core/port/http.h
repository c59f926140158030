// A minimal HTTP client for this host's own plain-HTTP endpoints (the coordinator's and workers'
// Prometheus /metrics pages), used by `meshrun bench` and the tests.
#ifndef MESHRUN_CORE_PORT_HTTP_H_
#define MESHRUN_CORE_PORT_HTTP_H_

#include <string>

namespace meshrun {

// GET http://host:port/path (HTTP/1.0 over a plain socket) and return the body; "" when the
// address does not resolve, the connection fails, or no complete response comes within
// `timeout_seconds` per read. Thread-safe.
std::string HttpGet(const std::string& host_port, const std::string& path,
                    double timeout_seconds = 10);

}  // namespace meshrun

#endif  // MESHRUN_CORE_PORT_HTTP_H_
