// TestEngine: a scriptable Engine for runtime tests. It records what the runtime bound and on which
// stream it enqueued, and runs a test-supplied function as its "network".
//
//   auto engine = std::make_unique<TestEngine>(bindings, {{"k_out", "k"}});
//   engine->on_enqueue = [](TestEngine& e) { ...write through e.address("k_out")... };
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cc/engines/engine.h"

namespace zerokv::engines {

class TestEngine final : public Engine {
 public:
  struct Bound {
    void* data = nullptr;
    size_t capacity = 0;
  };

  // `aliases` maps an output to the input it is written through.
  TestEngine(std::vector<EngineBinding> bindings, std::map<std::string, std::string> aliases,
             ComputeDevice device = ComputeDevice::kHost)
      : bindings_(std::move(bindings)), aliases_(std::move(aliases)), device_(device) {}

  ComputeDevice compute_device() const override { return device_; }
  const std::vector<EngineBinding>& bindings() const override { return bindings_; }
  std::optional<std::string> AliasedInput(const std::string& output) const override {
    auto alias = aliases_.find(output);
    if (alias == aliases_.end()) return std::nullopt;
    return alias->second;
  }
  Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) override {
    input_shapes[name] = shape;
    return Status::Ok();
  }
  Status SetAddress(const std::string& name, void* data, size_t capacity) override {
    bound[name] = {data, capacity};
    return Status::Ok();
  }
  Status Enqueue(StreamHandle stream) override {
    ++enqueue_count;
    last_stream = stream;
    if (on_enqueue) return on_enqueue(*this);
    return Status::Ok();
  }
  Status Prepare(StreamHandle stream) override {
    prepared.push_back({bound, input_shapes, stream});
    return prepare_status;
  }
  Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const override {
    auto found = output_shapes.find(name);
    if (found == output_shapes.end()) {
      return base::Internal("test engine: no shape set for output '" + name + "'");
    }
    *shape = found->second;
    return Status::Ok();
  }

  // What the runtime did, for the test to inspect.
  struct Preparation {
    std::map<std::string, Bound> bound;
    std::map<std::string, std::vector<int64_t>> input_shapes;
    StreamHandle stream = nullptr;
  };
  std::vector<Preparation> prepared;  // the binding of each Prepare
  std::map<std::string, Bound> bound;
  std::map<std::string, std::vector<int64_t>> input_shapes;
  int enqueue_count = 0;
  StreamHandle last_stream = nullptr;

  // What the test scripts.
  std::map<std::string, std::vector<int64_t>> output_shapes;
  std::function<Status(TestEngine&)> on_enqueue;
  Status prepare_status = Status::Ok();  // what Prepare returns

 private:
  std::vector<EngineBinding> bindings_;
  std::map<std::string, std::string> aliases_;
  ComputeDevice device_;
};

}  // namespace zerokv::engines
