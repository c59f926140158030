// The meshrun CLI's subcommands, declared on a CLI::App (CLI11). Each Add* function declares a
// subcommand's flags into state that its callback owns, and the callback, which CLI11 calls once
// the command line parsed, runs the command and stores its exit status in `*exit_code`. A
// CLI::ParseError thrown by a callback (a flag that is missing or out of range) ends the parse
// as CLI11_PARSE reports it. Not thread-safe (one parse per process).
#ifndef MESHRUN_CLIENT_CLI_FLAGS_H_
#define MESHRUN_CLIENT_CLI_FLAGS_H_

#include "CLI/CLI.hpp"

namespace meshrun::cli {

// Help shared by several subcommands' flags.
inline constexpr const char kPrecisionHelp[] =
    "the layers' compute dtype: bf16 is mixed precision (bf16 GEMMs accumulating in f32; f32 "
    "parameters, gradients and optimizer state)";
inline constexpr const char kNoShmHelp[] =
    "collectives over the loopback gRPC ring, as between hosts (default: shared memory)";

// `meshrun bench allreduce|collectives|train|input|step|kernels|ckpt` (bench/bench.h).
void AddBenchCommands(CLI::App& app, int* exit_code);

}  // namespace meshrun::cli

#endif  // MESHRUN_CLIENT_CLI_FLAGS_H_
