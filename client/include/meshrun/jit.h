// The SDK's global-program builder and partitioner (JitBuilder, jax.jit). It lives in
// core/spmd/jit.h: the coordinator replays and partitions the same global programs (Client::Jit).
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_JIT_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_JIT_H_

#include "core/spmd/jit.h"  // IWYU pragma: export

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_JIT_H_
