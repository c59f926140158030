// Running a per-shard program on the two ranks of Mesh('data': 2), each in its own thread over
// in-process transports (which reach each other's memory: single-copy collectives run), for the
// worker's tests of collectives inside programs.
#ifndef MESHRUN_TESTS_WORKER_TWO_RANKS_H_
#define MESHRUN_TESTS_WORKER_TWO_RANKS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/collectives/communicator.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

// Runs `program` on the two ranks of Mesh('data': 2) with `collectives`, element i of input
// `name` (f32) on rank r set to value(name, r, i), and returns each rank's f32 `results` side by
// side. Failures are reported as test failures (the rank's results are then missing).
std::vector<std::vector<float>> RunOnTwoRanks(
    const v1::StepProgram& program, const CollectiveOptions& collectives,
    const std::vector<std::string>& inputs,
    const std::function<float(const std::string& name, int r, int64_t i)>& value,
    const std::vector<std::string>& results);

// A StepProgram from its text format (a test failure if it does not parse).
v1::StepProgram ParseText(const std::string& text);

}  // namespace meshrun

#endif  // MESHRUN_TESTS_WORKER_TWO_RANKS_H_
