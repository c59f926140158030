// Operating-system facts about other processes on this host (Linux /proc), as LevelDB keeps its
// platform code in port/.
#ifndef MESHRUN_CORE_PORT_PROCESS_H_
#define MESHRUN_CORE_PORT_PROCESS_H_

#include <cstdint>

namespace meshrun {

// Whether process `pid` on this host is alive: it exists and is neither a zombie (exited, not yet
// reaped by its parent) nor dead. A pid <= 0 (unknown) counts as alive, so callers fall back on
// their deadlines. Thread-safe; reads /proc/PID/stat.
bool ProcessAlive(int64_t pid);

// This host's physical memory in bytes (sysconf), or 2^46 if it cannot be read.
int64_t PhysicalMemoryBytes();

}  // namespace meshrun

#endif  // MESHRUN_CORE_PORT_PROCESS_H_
