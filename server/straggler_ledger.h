// The straggler ledger: every collective's arrival skew across the ranks of its group, from the
// arrival times the workers report with each run (RunShardMapResponse.arrivals). NCCL and Gloo
// have no such ledger on CPU; torch's flight recorder keeps per-rank entries for a post-mortem.
#ifndef MESHRUN_SERVER_STRAGGLER_LEDGER_H_
#define MESHRUN_SERVER_STRAGGLER_LEDGER_H_

#include <string>
#include <vector>

#include "core/sharding/mesh.h"
#include "meshrun/v1/worker.pb.h"

namespace meshrun {

// One collective of one run on one group (the ranks that differ only along its axes).
struct CollectiveSkew {
  std::string op;      // "psum", "all_gather", ...
  std::string axes;    // "data", "i,j"
  double seconds = 0;  // the last arrival minus the first (wall clocks; across hosts they are as
                       // close as NTP keeps them)
  int late_rank = -1;  // the rank that arrived last
};

// The skew of every collective group that more than one rank reported. `responses[r]` is rank
// r's response on `mesh`; a rank may report fewer arrivals (the workers keep the first 4096 per
// call). Entries naming an axis `mesh` lacks are skipped.
std::vector<CollectiveSkew> ArrivalSkews(const Mesh& mesh,
                                         const std::vector<v1::RunShardMapResponse>& responses);

}  // namespace meshrun

#endif  // MESHRUN_SERVER_STRAGGLER_LEDGER_H_
