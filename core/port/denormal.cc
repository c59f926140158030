#include "core/port/denormal.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace meshrun {
namespace {
#if defined(__SSE__)
constexpr unsigned kFlushToZero = 0x8000;       // MXCSR.FTZ
constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR.DAZ
#endif
}  // namespace

void FlushDenormalsToZero() {
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero);
#endif
}

bool DenormalsFlushToZero() {
#if defined(__SSE__)
  const unsigned both = kFlushToZero | kDenormalsAreZero;
  return (_mm_getcsr() & both) == both;
#else
  return false;
#endif
}

}  // namespace meshrun
