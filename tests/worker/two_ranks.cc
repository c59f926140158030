#include "tests/worker/two_ranks.h"

#include <memory>
#include <thread>

#include "core/collectives/in_process_transport.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {

std::vector<std::vector<float>> RunOnTwoRanks(
    const v1::StepProgram& program, const CollectiveOptions& collectives,
    const std::vector<std::string>& inputs,
    const std::function<float(const std::string& name, int r, int64_t i)>& value,
    const std::vector<std::string>& results) {
  const Mesh mesh = *Mesh::Parse("data=2");
  std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
  std::vector<std::vector<float>> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Executor::Options o;
      o.mesh = &mesh;
      o.rank = r;
      o.transport = transports[r].get();
      o.collectives = collectives;
      o.results = results;
      auto ex = Executor::Create(program, o);
      ASSERT_TRUE(ex.ok()) << ex.status();
      for (const std::string& name : inputs) {
        Tensor t(v1::DTYPE_F32, (*ex)->buffer(name)->dims());
        for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = value(name, r, i);
        ASSERT_TRUE((*ex)->BindInput(name, t).ok());
      }
      absl::Status s = (*ex)->Run("main", RunContext{});
      ASSERT_TRUE(s.ok()) << s;
      for (const std::string& name : results) {
        const Tensor* t = (*ex)->buffer(name);
        got[r].insert(got[r].end(), t->data<float>(), t->data<float>() + t->num_elements());
      }
    });
  }
  for (auto& t : threads) t.join();
  return got;
}

v1::StepProgram ParseText(const std::string& text) {
  v1::StepProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p)) << text;
  return p;
}

}  // namespace meshrun
