// FlushDenormalsToZero: a thread's denormal products become 0 once it is set, and threads it
// starts afterwards inherit the mode (as the worker relies on for gRPC's and oneDNN's threads).
#include "core/port/denormal.h"

#include <thread>

#include "gtest/gtest.h"

namespace meshrun {
namespace {

float DenormalProduct() {
  volatile float a = 1e-30f, b = 1e-10f;  // 1e-40 is below FLT_MIN (1.18e-38): a denormal
  return a * b;
}

TEST(FlushDenormalsTest, ProductsFlushOnceSetAndNewThreadsInheritTheMode) {
  std::thread([] {
    EXPECT_FALSE(DenormalsFlushToZero()) << "IEEE default: denormals kept";
    EXPECT_GT(DenormalProduct(), 0.0f);
    FlushDenormalsToZero();
    EXPECT_TRUE(DenormalsFlushToZero());
    EXPECT_EQ(DenormalProduct(), 0.0f);
    volatile float normal = 1e-20f;
    EXPECT_GT(normal * 1e-10f, 0.0f) << "normal results are untouched";
    std::thread([] {
      EXPECT_TRUE(DenormalsFlushToZero());
      EXPECT_EQ(DenormalProduct(), 0.0f);
    }).join();
  }).join();
}

}  // namespace
}  // namespace meshrun
