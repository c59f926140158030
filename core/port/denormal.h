// Floating-point mode of the compute threads: denormals flushed to zero, as JAX computes on CPU
// (XLA:CPU sets FTZ and DAZ; jax-ml/jax#4042: "JAX has flush-denormal-to-zero semantics on CPU")
// and TensorFlow runs its threads. Denormal arithmetic takes microcode assists, tens of times
// slower: Adam's moments of a parameter whose gradient stays zero (a dead ReLU unit's) decay into
// denormals after some hundred steps, and the whole update slows down with them.
#ifndef MESHRUN_CORE_PORT_DENORMAL_H_
#define MESHRUN_CORE_PORT_DENORMAL_H_

namespace meshrun {

// Sets flush-to-zero (a denormal result becomes 0) and denormals-are-zero (a denormal operand
// reads as 0) for the calling thread; threads it creates afterwards inherit the mode. No effect
// on CPUs other than x86 with SSE. Thread-safe (per-thread state).
void FlushDenormalsToZero();

// Whether the calling thread flushes denormals (both modes set).
bool DenormalsFlushToZero();

}  // namespace meshrun

#endif  // MESHRUN_CORE_PORT_DENORMAL_H_
