#include "core/config/job_config.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace meshrun {
namespace {

using json = nlohmann::json;
using Setter = std::function<absl::Status(const std::string& key, const json& value)>;

absl::Status Bad(const std::string& key, const json& value, absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", key, "' is ", value.dump(), "; expected ", expected));
}

Setter Int(int64_t* out, int64_t lo, int64_t hi) {
  return [=](const std::string& key, const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      return Bad(key, v, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
    }
    *out = v.get<int64_t>();
    return absl::OkStatus();
  };
}
Setter Int(int* out, int lo, int hi) {
  return [=](const std::string& key, const json& v) {
    int64_t tmp = 0;
    absl::Status s = Int(&tmp, lo, hi)(key, v);
    if (s.ok()) *out = static_cast<int>(tmp);
    return s;
  };
}
Setter Num(double* out, double lo, double hi, bool lo_open = false) {
  return [=](const std::string& key, const json& v) {
    if (!v.is_number() || v.get<double>() > hi || v.get<double>() < lo ||
        (lo_open && v.get<double>() == lo)) {
      return Bad(key, v, absl::StrCat("a number in ", lo_open ? "(" : "[", lo, ", ", hi, "]"));
    }
    *out = v.get<double>();
    return absl::OkStatus();
  };
}
Setter Enum(std::string* out, std::vector<std::string> allowed) {
  return [=](const std::string& key, const json& v) {
    for (const auto& a : allowed) {
      if (v.is_string() && v.get<std::string>() == a) {
        *out = a;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "' is ", v.dump(), "; allowed: ", absl::StrJoin(allowed, ", ")));
  };
}
Setter Str(std::string* out) {
  return [=](const std::string& key, const json& v) {
    if (!v.is_string() || v.get<std::string>().empty()) return Bad(key, v, "a non-empty string");
    *out = v.get<std::string>();
    return absl::OkStatus();
  };
}
Setter Bool(bool* out) {
  return [=](const std::string& key, const json& v) {
    if (!v.is_boolean()) return Bad(key, v, "true or false");
    *out = v.get<bool>();
    return absl::OkStatus();
  };
}

// Flax's logical axis rules as JSON: [["batch", "data"], ["hidden", "model"], ["embed", null],
// ["heads", ["data", "model"]]], stored as ParseLogicalAxisRules' text ("batch=data,...").
Setter Rules(std::string* out) {
  return [=](const std::string& key, const json& v) {
    const absl::string_view expected =
        "a list of [logical axis, mesh axis | [mesh axes] | null] pairs";
    if (!v.is_array()) return Bad(key, v, expected);
    std::vector<std::string> rules;
    for (const json& rule : v) {
      if (!rule.is_array() || rule.size() != 2 || !rule[0].is_string() ||
          rule[0].get<std::string>().empty()) {
        return Bad(key, rule, expected);
      }
      std::string mesh_axes;
      if (rule[1].is_string()) {
        mesh_axes = rule[1].get<std::string>();
      } else if (rule[1].is_array() && !rule[1].empty()) {
        std::vector<std::string> axes;
        for (const json& a : rule[1]) {
          if (!a.is_string()) return Bad(key, rule, expected);
          axes.push_back(a.get<std::string>());
        }
        mesh_axes = absl::StrJoin(axes, "+");
      } else if (!rule[1].is_null()) {
        return Bad(key, rule, expected);
      }
      rules.push_back(absl::StrCat(rule[0].get<std::string>(), "=", mesh_axes));
    }
    *out = absl::StrJoin(rules, ",");
    return absl::OkStatus();
  };
}

absl::Status ApplySection(const std::string& section, const json& obj,
                          const std::map<std::string, Setter>& setters) {
  if (!obj.is_object()) return Bad(section, obj, "an object");
  for (const auto& [key, value] : obj.items()) {
    auto it = setters.find(key);
    if (it == setters.end()) {
      std::vector<std::string> allowed;
      for (const auto& [k, _] : setters) allowed.push_back(k);
      return absl::InvalidArgumentError(absl::StrCat("unknown key '", section, ".", key,
                                                     "'; allowed: ", absl::StrJoin(allowed, ", ")));
    }
    if (absl::Status s = it->second(absl::StrCat(section, ".", key), value); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLossFinite(int64_t step, double loss) {
  if (std::isfinite(loss)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "non-finite loss ", loss, " at step ", step,
      ": the job stops (train.on_nonfinite: stop) and no checkpoint of this state is committed"));
}

namespace {

// The sections' keys and where each value goes in `c` (train.seed through `seed`, an int64).
std::map<std::string, std::map<std::string, Setter>> Schema(JobConfig& c, int64_t& seed) {
  return {
      {"model",
       {{"name", Enum(&c.model.name, {"dp_classifier", "mlp", "dot_relu_dot", "classifier"})},
        {"hidden_size", Int(&c.model.hidden_size, 1, 1 << 16)},
        {"num_classes", Int(&c.model.num_classes, 2, 1 << 16)},
        {"dropout_rate", Num(&c.model.dropout_rate, 0.0, 0.95)}}},
      {"optimizer",
       {{"name", Enum(&c.optimizer.name, {"adamw", "adam", "sgd"})},
        {"learning_rate", Num(&c.optimizer.learning_rate, 0.0, 10.0, true)},
        {"b1", Num(&c.optimizer.b1, 0.0, 0.999999)},
        {"b2", Num(&c.optimizer.b2, 0.0, 0.999999)},
        {"eps", Num(&c.optimizer.eps, 0.0, 1.0, true)},
        {"weight_decay", Num(&c.optimizer.weight_decay, 0.0, 1.0)},
        {"num_minibatches", Int(&c.optimizer.num_minibatches, 1, 1024)}}},
      {"data",
       {{"dataset", Enum(&c.data.dataset, {"fashion_mnist", "npy", "synthetic"})},
        {"path", Str(&c.data.path)},
        {"eval_path", Str(&c.data.eval_path)},
        {"batch_size", Int(&c.data.batch_size, 1, 1 << 24)},
        {"eval_batch_size", Int(&c.data.eval_batch_size, 0, 1 << 24)},
        {"shuffle", Bool(&c.data.shuffle)},
        {"drop_remainder", Bool(&c.data.drop_remainder)}}},
      {"train",
       {{"epochs", Int(&c.train.epochs, 1, 1000)},
        {"max_steps", Int(&c.train.max_steps, 0, int64_t{1} << 40)},
        {"seed", Int(&seed, 0, (int64_t{1} << 53))},
        {"log_every", Int(&c.train.log_every, 1, 1000000)},
        {"evaluate", Bool(&c.train.evaluate)},
        {"collective_timeout_seconds", Num(&c.train.collective_timeout_seconds, 0.0, 3600.0, true)},
        {"on_nonfinite", Enum(&c.train.on_nonfinite, {"stop", "skip_step"})},
        {"when_busy", Enum(&c.train.when_busy, {"queue", "refuse"})}}},
      {"sharding",
       {{"layout", Str(&c.sharding.layout)},
        {"rules", Rules(&c.sharding.rules)},
        {"fsdp_axis", Str(&c.sharding.fsdp_axis)},
        {"min_weight_size", Int(&c.sharding.min_weight_size, 0, int64_t{1} << 40)}}},
      {"precision",
       {{"compute", Enum(&c.precision.compute, {"f32", "bf16"})},
        {"reduce", Enum(&c.precision.reduce, {"f32", "bf16"})}}},
      {"recovery",
       {{"max_restarts", Int(&c.recovery.max_restarts, 0, 1000)},
        {"timeout_seconds", Num(&c.recovery.timeout_seconds, 0.0, 86400.0, true)},
        {"min_workers", Int(&c.recovery.min_workers, 0, 1 << 20)},
        {"peer_state_every", Int(&c.recovery.peer_state_every, 0, 1 << 30)}}},
      {"checkpoint",
       {{"dir", Str(&c.checkpoint.dir)},
        {"save_every", Int(&c.checkpoint.save_every, 0, 1 << 30)},
        {"keep", Int(&c.checkpoint.keep, 0, 1 << 20)},
        {"async", Bool(&c.checkpoint.async)},
        {"resume", Bool(&c.checkpoint.resume)},
        {"init_from", Str(&c.checkpoint.init_from)}}},
  };
}

// "mesh": an object of axis name -> size, in order.
absl::Status ParseMesh(const json& value, std::vector<std::pair<std::string, int>>& mesh) {
  if (!value.is_object() || value.empty())
    return Bad("mesh", value, "an object of axis name -> size");
  for (const auto& [axis, size] : value.items()) {
    if (!size.is_number_integer() || size.get<int64_t>() < 1 || size.get<int64_t>() > 4096) {
      return Bad(absl::StrCat("mesh.", axis), size, "an integer in [1, 4096]");
    }
    mesh.emplace_back(axis, size.get<int>());
  }
  return absl::OkStatus();
}

// The rules that span keys (and the defaults one key's absence implies), checked once every key
// is read.
absl::Status CheckAcrossKeys(const json& root, JobConfig& c) {
  if (!root.contains("data") && c.model.name != "dp_classifier") {
    c.data.dataset = "synthetic";  // a seed workload's own batch, every step
  }
  if (c.data.dataset == "npy" && !root.at("data").contains("path")) {
    return absl::InvalidArgumentError(
        "'data.dataset' is npy but 'data.path' (the directory of .npy files) is not set");
  }
  if (c.data.dataset == "synthetic" && c.model.name == "dp_classifier") {
    return absl::InvalidArgumentError(
        "'data.dataset' synthetic is a seed workload's own batch (model.name mlp, dot_relu_dot or "
        "classifier); dp_classifier reads fashion_mnist or npy");
  }
  if (!c.sharding.layout.empty() && (!c.sharding.rules.empty() || !c.sharding.fsdp_axis.empty())) {
    return absl::InvalidArgumentError(
        "'sharding.layout' names a layout; give either it or 'sharding.rules' / "
        "'sharding.fsdp_axis'");
  }
  if (c.checkpoint.dir.empty()) {
    for (auto [key, set] : {std::pair<const char*, bool>{"save_every", c.checkpoint.save_every > 0},
                            {"keep", c.checkpoint.keep > 0},
                            {"async", c.checkpoint.async},
                            {"resume", c.checkpoint.resume}}) {
      if (set) {
        return absl::InvalidArgumentError(
            absl::StrCat("'checkpoint.", key, "' is set but 'checkpoint.dir' is not"));
      }
    }
  }
  if (c.data.batch_size % c.optimizer.num_minibatches != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'data.batch_size' (", c.data.batch_size,
        ") must be divisible by 'optimizer.num_minibatches' (", c.optimizer.num_minibatches, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobConfig> ParseJobConfig(absl::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {  // a syntax error ("parse error at line 3, column 9:
    // ..."), or a number past double's range (out_of_range 406)
    return absl::InvalidArgumentError(absl::StrCat("job config is not valid JSON: ", e.what()));
  }
  if (!root.is_object()) return absl::InvalidArgumentError("job config must be a JSON object");
  JobConfig c;
  int64_t seed = static_cast<int64_t>(c.train.seed);
  const std::map<std::string, std::map<std::string, Setter>> schema = Schema(c, seed);
  for (const auto& [key, value] : root.items()) {
    if (key == "mesh") {
      if (absl::Status s = ParseMesh(value, c.mesh); !s.ok()) return s;
      continue;
    }
    auto it = schema.find(key);
    if (it == schema.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown key '", key,
                       "'; allowed: checkpoint, data, mesh, model, optimizer, precision, recovery, "
                       "sharding, train"));
    }
    if (absl::Status s = ApplySection(key, value, it->second); !s.ok()) return s;
  }
  c.train.seed = static_cast<uint64_t>(seed);
  if (absl::Status s = CheckAcrossKeys(root, c); !s.ok()) return s;
  return c;
}

absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("job config file ", path, " cannot be read"));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<JobConfig> c = ParseJobConfig(ss.str());
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

std::string JobConfigToJson(const JobConfig& c) {
  json root;
  json mesh = json::object();
  for (const auto& [name, size] : c.mesh) mesh[name] = size;
  if (!c.mesh.empty()) root["mesh"] = mesh;
  root["model"] = {{"name", c.model.name},
                   {"hidden_size", c.model.hidden_size},
                   {"num_classes", c.model.num_classes},
                   {"dropout_rate", c.model.dropout_rate}};
  root["optimizer"] = {{"name", c.optimizer.name},
                       {"learning_rate", c.optimizer.learning_rate},
                       {"b1", c.optimizer.b1},
                       {"b2", c.optimizer.b2},
                       {"eps", c.optimizer.eps},
                       {"weight_decay", c.optimizer.weight_decay},
                       {"num_minibatches", c.optimizer.num_minibatches}};
  {
    root["sharding"] = {{"min_weight_size", c.sharding.min_weight_size}};
    if (!c.sharding.layout.empty()) root["sharding"]["layout"] = c.sharding.layout;
    if (!c.sharding.fsdp_axis.empty()) root["sharding"]["fsdp_axis"] = c.sharding.fsdp_axis;
    if (!c.sharding.rules.empty()) {
      json rules = json::array();
      for (absl::string_view rule : absl::StrSplit(c.sharding.rules, ',')) {
        std::pair<std::string, std::string> kv = absl::StrSplit(rule, absl::MaxSplits('=', 1));
        json target = nullptr;
        if (kv.second.find('+') != std::string::npos) {
          target = json::array();
          for (absl::string_view a : absl::StrSplit(kv.second, '+'))
            target.push_back(std::string(a));
        } else if (!kv.second.empty()) {
          target = kv.second;
        }
        rules.push_back({kv.first, target});
      }
      root["sharding"]["rules"] = rules;
    }
  }
  root["data"] = {{"dataset", c.data.dataset},       {"path", c.data.path},
                  {"batch_size", c.data.batch_size}, {"eval_batch_size", c.data.eval_batch_size},
                  {"shuffle", c.data.shuffle},       {"drop_remainder", c.data.drop_remainder}};
  if (!c.data.eval_path.empty()) root["data"]["eval_path"] = c.data.eval_path;
  root["train"] = {{"epochs", c.train.epochs},
                   {"max_steps", c.train.max_steps},
                   {"seed", c.train.seed},
                   {"log_every", c.train.log_every},
                   {"evaluate", c.train.evaluate},
                   {"collective_timeout_seconds", c.train.collective_timeout_seconds},
                   {"on_nonfinite", c.train.on_nonfinite},
                   {"when_busy", c.train.when_busy}};
  root["precision"] = {{"compute", c.precision.compute}, {"reduce", c.precision.reduce}};
  root["recovery"] = {{"max_restarts", c.recovery.max_restarts},
                      {"timeout_seconds", c.recovery.timeout_seconds},
                      {"min_workers", c.recovery.min_workers},
                      {"peer_state_every", c.recovery.peer_state_every}};
  root["checkpoint"] = {{"save_every", c.checkpoint.save_every},
                        {"keep", c.checkpoint.keep},
                        {"async", c.checkpoint.async},
                        {"resume", c.checkpoint.resume}};
  if (!c.checkpoint.dir.empty()) root["checkpoint"]["dir"] = c.checkpoint.dir;
  if (!c.checkpoint.init_from.empty()) root["checkpoint"]["init_from"] = c.checkpoint.init_from;
  return root.dump(2);
}

}  // namespace meshrun
