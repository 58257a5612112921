// The runtime-owned KV model of the runtime tests: a blob (RuntimeKvBlob) and a TestEngine that
// runs it (RuntimeKvEngine), so a test can prove where each step wrote and what it saw.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cc/blob/blob.h"
#include "cc/engines/testing/test_engine.h"

namespace zerokv::runtime::testing {

using base::Internal;

using blob::AliasedIO;
using blob::AliasKind;
using blob::Device;
using blob::Dim;
using blob::Direction;
using blob::DType;
using blob::IOBinding;
using base::ComputeDevice;
using engines::TestEngine;

// The engine bindings a blob records (name, direction, dtype).
inline std::vector<engines::EngineBinding> EngineBindingsOf(const blob::Blob& blob) {
  std::vector<engines::EngineBinding> bindings;
  for (const IOBinding& binding : blob.metadata.bindings) {
    bindings.push_back({binding.name, binding.direction, binding.dtype});
  }
  return bindings;
}

// Runtime-owned caches: tokens [1, 1..4] int64 (the step width is its dim 1) and position, which
// the runtime fills with the step's positions: [1] (the first) or [T] (each) -> logits [1, T, 3];
// K and V [1, 2, capacity, 4] owned by the runtime, written in place through k_out / v_out. A ring
// layer also takes slots [T], which the runtime fills with each token's write slot. Neither the
// caches nor their aliased outputs are arguments.
inline blob::Blob RuntimeKvBlob(const std::string& storage_key, uint64_t initial, uint64_t max,
                                Dim positions = Dim{1, -1},
                                blob::KVPolicy policy = blob::KVPolicy::kFlat, uint64_t window = 0,
                                Dim position_elements = Dim{1, 1}) {
  blob::Blob blob;
  blob.engine_kind = blob::EngineKind::kTensorrt;
  const bool ring = policy == blob::KVPolicy::kRing;
  auto cache = [&](const char* name, Direction direction) {
    return IOBinding{name, DType::kFloat32, direction, Device::kCuda,
                     {Dim{1, 1}, Dim{2, 2}, positions, Dim{4, 4}}};
  };
  blob.metadata.bindings = {
      IOBinding{"tokens", DType::kInt64, Direction::kInput, Device::kCuda, {Dim{1, 1}, Dim{1, 4}}},
      IOBinding{"position", DType::kInt64, Direction::kInput, Device::kCuda, {position_elements}},
      cache("k", Direction::kInput),
      cache("v", Direction::kInput),
  };
  if (ring) {
    blob.metadata.bindings.push_back(
        IOBinding{"slots", DType::kInt32, Direction::kInput, Device::kCuda, {Dim{1, 4}}});
  }
  blob.metadata.bindings.push_back(IOBinding{"logits", DType::kFloat32, Direction::kOutput,
                                             Device::kCuda, {Dim{1, 1}, Dim{1, 4}, Dim{3, 3}}});
  blob.metadata.bindings.push_back(cache("k_out", Direction::kOutput));
  blob.metadata.bindings.push_back(cache("v_out", Direction::kOutput));
  blob.metadata.aliased_io = {AliasedIO{"k_out", "k", AliasKind::kKvCacheUpdate},
                              AliasedIO{"v_out", "v", AliasKind::kKvCacheUpdate}};
  blob.metadata.kv_layers = {blob::KVLayer{"k", "v", storage_key, DType::kFloat32, 2, 4, policy,
                                           window, initial, max, ring ? "slots" : ""}};
  blob.metadata.step_width_source = "0:1";
  blob.metadata.positions_binding = "position";
  return blob;
}

// `blob` (a RuntimeKvBlob of a flat layer) with `layers` layers: layer i > 0 repeats layer 0
// through bindings k.i, v.i, k.i_out and v.i_out, over storage key "<layer 0's key>.i".
inline blob::Blob WithLayers(blob::Blob blob, size_t layers) {
  const blob::KVLayer first = blob.metadata.kv_layers[0];
  const std::vector<IOBinding> bindings = blob.metadata.bindings;
  for (size_t i = 1; i < layers; ++i) {
    const std::string suffix = "." + std::to_string(i);
    for (const IOBinding& binding : bindings) {
      for (const std::string& input : {first.k_binding, first.v_binding}) {
        IOBinding added = binding;
        if (binding.name == input) {
          added.name = input + suffix;
        } else if (binding.name == input + "_out") {
          added.name = input + suffix + "_out";
        } else {
          continue;
        }
        blob.metadata.bindings.push_back(added);
      }
    }
    for (const std::string& input : {first.k_binding, first.v_binding}) {
      blob.metadata.aliased_io.push_back(
          AliasedIO{input + suffix + "_out", input + suffix, AliasKind::kKvCacheUpdate});
    }
    blob::KVLayer layer = first;
    layer.k_binding += suffix;
    layer.v_binding += suffix;
    layer.storage_key += suffix;
    blob.metadata.kv_layers.push_back(layer);
  }
  return blob;
}

// The model: token t of the step is at position[t] (or position[0] + t when position holds one
// element) and is written, as position + 1 in K and -(position + 1) in V, at that position, or at
// slots[t] on a ring, in every layer (through the output named for its input, + "_out"); then
// logits[t] counts the positions of the first layer's K's first row that hold data, so a step
// proves it sees every earlier step. A write past the bound capacity fails.
inline std::unique_ptr<TestEngine> RuntimeKvEngine(const blob::Blob& blob, bool ring = false) {
  std::map<std::string, std::string> aliases;
  for (const AliasedIO& alias : blob.metadata.aliased_io) aliases[alias.output] = alias.input;
  std::vector<std::string> layers;  // each layer's K binding, then its V binding
  for (const blob::KVLayer& layer : blob.metadata.kv_layers) {
    layers.push_back(layer.k_binding);
    layers.push_back(layer.v_binding);
  }
  auto engine = std::make_unique<TestEngine>(EngineBindingsOf(blob), std::move(aliases),
                                             ComputeDevice::kCuda);
  engine->on_enqueue = [ring, layers](TestEngine& e) -> Status {
    const int64_t steps = e.input_shapes["tokens"][1];
    const auto* position = static_cast<const int64_t*>(e.bound["position"].data);
    const bool per_token = e.input_shapes["position"][0] == steps;
    for (size_t layer = 0; layer < layers.size(); layer += 2) {
      const int64_t capacity = e.input_shapes[layers[layer]][2];
      float* k = static_cast<float*>(e.bound[layers[layer] + "_out"].data);
      float* v = static_cast<float*>(e.bound[layers[layer + 1] + "_out"].data);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t at = per_token ? position[t] : position[0] + t;
        const int64_t slot = ring ? static_cast<const int32_t*>(e.bound["slots"].data)[t] : at;
        if (slot < 0 || slot >= capacity) return Internal("test model: write past the capacity");
        for (int64_t row = 0; row < 2; ++row) {
          for (int64_t d = 0; d < 4; ++d) {
            k[(row * capacity + slot) * 4 + d] = static_cast<float>(at + 1);
            v[(row * capacity + slot) * 4 + d] = -static_cast<float>(at + 1);
          }
        }
      }
    }
    const int64_t capacity = e.input_shapes[layers[0]][2];
    const auto* k = static_cast<const float*>(e.bound[layers[0] + "_out"].data);
    int64_t filled = 0;
    for (int64_t slot = 0; slot < capacity; ++slot) filled += k[slot * 4] != 0.0f;
    float* logits = static_cast<float*>(e.bound["logits"].data);
    for (int64_t i = 0; i < steps * 3; ++i) logits[i] = static_cast<float>(filled);
    e.output_shapes["logits"] = {1, steps, 3};
    return Status::Ok();
  };
  return engine;
}

}  // namespace zerokv::runtime::testing
