// A Transport whose ranks are threads of one process: for fast, deterministic collective tests.
#ifndef MESHRUN_CORE_COLLECTIVES_IN_PROCESS_TRANSPORT_H_
#define MESHRUN_CORE_COLLECTIVES_IN_PROCESS_TRANSPORT_H_

#include <memory>
#include <vector>

#include "core/collectives/mailbox.h"
#include "core/collectives/transport.h"

namespace meshrun {

// Creates `world_size` connected transports; transport i is rank i. The returned objects share
// their mailboxes and must all outlive any call on any of them. Thread-safe as Transport.
std::vector<std::unique_ptr<Transport>> CreateInProcessTransports(int world_size);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_IN_PROCESS_TRANSPORT_H_
