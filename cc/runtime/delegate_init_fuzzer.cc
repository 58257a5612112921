// libFuzzer target over the delegate's init path: a blob that parses is checked against an engine's
// bindings and aliases and against its KV manifest (Delegate::Create, with a test engine).
//
// Input: a blob (header.blob_size bytes), then bytes that perturb the engine. With none, the engine
// reports exactly the blob's bindings and aliases, so the fixtures (the seeds) start on the path
// that creates a delegate. Whatever the input, Create gives a delegate or a refusal that says why;
// a delegate takes the blob's signature, every alias the engine reports is one the blob records,
// and destroying it frees everything Create took. ASan and UBSan catch the rest.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "cc/base/testing/counting_device_ops.h"
#include "cc/blob/blob.h"
#include "cc/engines/testing/test_engine.h"
#include "cc/runtime/delegate.h"

namespace {

using zerokv::blob::Direction;
using zerokv::blob::DType;
using zerokv::engines::ComputeDevice;
using zerokv::engines::EngineBinding;

constexpr size_t kBlobSizeAt = 16;  // header.blob_size: after magic, version, sizes, kind, flags, device

// The blob's own length: what its header says, when the input holds that much.
size_t BlobLength(const uint8_t* data, size_t size) {
  if (size < kBlobSizeAt + 8) return size;
  uint64_t declared = 0;
  for (size_t i = 0; i < 8; ++i) declared |= uint64_t{data[kBlobSizeAt + i]} << (8 * i);
  return declared < size ? static_cast<size_t>(declared) : size;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const size_t length = BlobLength(data, size);
  // A copy of exactly the blob, so that ASan sees any read past it.
  const std::vector<uint8_t> bytes(data, data + length);
  zerokv::blob::Blob blob;
  if (zerokv::blob::Parse(bytes.data(), bytes.size(), &blob)) return 0;
  FuzzedDataProvider perturb(data + length, size - length);  // all zeros once exhausted

  std::vector<EngineBinding> bindings;
  std::vector<std::string> inputs, outputs;
  for (const zerokv::blob::IOBinding& binding : blob.metadata.bindings) {
    EngineBinding engine{binding.name, binding.direction, binding.dtype};
    switch (perturb.ConsumeIntegralInRange<int>(0, 5)) {
      case 1:
        continue;  // the engine lacks it
      case 2:
        engine.name += "_";
        break;
      case 3:
        engine.direction = engine.direction == Direction::kInput ? Direction::kOutput : Direction::kInput;
        break;
      case 4:
        engine.dtype = engine.dtype == DType::kFloat32 ? DType::kInt64 : DType::kFloat32;
        break;
      case 5:
        bindings.push_back(engine);  // reported twice
        break;
    }
    (engine.direction == Direction::kInput ? inputs : outputs).push_back(engine.name);
    bindings.push_back(engine);
  }
  std::map<std::string, std::string> aliases;
  for (const zerokv::blob::AliasedIO& alias : blob.metadata.aliased_io) {
    switch (perturb.ConsumeIntegralInRange<int>(0, 2)) {
      case 0:
        aliases[alias.output] = alias.input;
        break;
      case 1:
        break;  // the engine does not alias it
      case 2:
        if (!inputs.empty()) aliases[alias.output] = inputs[perturb.ConsumeIntegralInRange<size_t>(0, inputs.size() - 1)];
        break;
    }
  }
  if (perturb.ConsumeBool() && !inputs.empty() && !outputs.empty()) {  // an alias the blob lacks
    aliases[outputs[perturb.ConsumeIntegralInRange<size_t>(0, outputs.size() - 1)]] =
        inputs[perturb.ConsumeIntegralInRange<size_t>(0, inputs.size() - 1)];
  }
  const ComputeDevice device = perturb.ConsumeBool() ? ComputeDevice::kCuda : ComputeDevice::kHost;

  zerokv::base::testing::CountingDeviceOps::Record record;
  record.capacity = 64 << 20;  // a small device: a blob's largest shapes may be any size
  std::unique_ptr<zerokv::runtime::Delegate> delegate;
  const zerokv::base::Status status = zerokv::runtime::Delegate::Create(
      blob, std::make_unique<zerokv::engines::TestEngine>(bindings, aliases, device),
      std::make_unique<zerokv::base::testing::CountingDeviceOps>(&record), "forward", &delegate);
  if (!status.ok()) {
    if (status.message().empty() || delegate) std::abort();  // a refusal says why, and creates nothing
    return 0;
  }
  if (delegate->arity() != zerokv::blob::ComputeDelegateSignature(blob.metadata, blob.aliased_outputs_elided).arity()) {
    std::abort();
  }
  for (const auto& [output, input] : aliases) {
    bool recorded = false;
    for (const zerokv::blob::AliasedIO& alias : blob.metadata.aliased_io) {
      recorded |= alias.output == output && alias.input == input;
    }
    if (!recorded) std::abort();  // the engine would overwrite an input nobody expects to change
  }
  delegate.reset();
  if (record.allocations_live != 0 || record.streams_created != record.streams_destroyed) std::abort();
  return 0;
}
