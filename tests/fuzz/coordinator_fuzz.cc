// libFuzzer target for what the coordinator does with a request before any worker is involved:
// the fuzzer's bytes are parsed as one message (bookworm has no libprotobuf-mutator), the first
// byte choosing which: a Jit request's global program, partitioned on a 2x2 mesh (sharding
// propagation, collectives, the VJP: server/partitioner.h); a PutArray's array and spec (size and
// layout checks); a job config as the client validates it (core/config/job_config.h); a
// checkpoint manifest as a restore reads it (core/checkpoint/checkpoint.h). A crash, a sanitizer
// report, a leak or a hang is a bug; an error Status is not.
#include <cstdint>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "core/config/job_config.h"
#include "core/sharding/named_sharding.h"
#include "core/tensor.h"
#include "meshrun/v1/coordinator.pb.h"
#include "server/partitioner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshrun;
  static const Mesh* mesh = new Mesh(*Mesh::Parse("data=2,model=2"));
  static Partitioner* partitioner = new Partitioner(*mesh, 2);
  if (size == 0) return 0;
  const uint8_t which = data[0] % 4;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (which) {
    case 0: {
      v1::JitRequest req;
      if (req.ParseFromString(bytes)) (void)partitioner->Partition(req.program());
      break;
    }
    case 1: {
      v1::PutArrayRequest req;
      if (!req.ParseFromString(bytes)) break;
      absl::StatusOr<Tensor> t = Tensor::FromProto(req.array());
      if (t.ok())
        (void)NamedSharding(*mesh, PartitionSpec::FromProto(req.spec())).Validate(t->dims());
      break;
    }
    case 2:
      (void)ParseJobConfig(bytes);
      break;
    default:
      (void)checkpoint::ParseManifest(bytes);
      break;
  }
  return 0;
}
