// The TensorRT engine kind: a thin adapter over the TensorRT C++ runtime API (TensorRT 10.15 or
// newer, checked when it compiles). The serialized engine (plan) is the named data entry the blob's
// engine_key names (format version 3 on; the blob's payload before), deserialized from the mapped
// bytes, which are released once TensorRT has built the engine; bindings,
// shapes and aliases are TensorRT's own:
//   deserializeCudaEngine, getIOTensorName/getTensorIOMode/getTensorDataType,
//   getAliasedInputTensor, setOptimizationProfileAsync, setInputShape, setTensorAddress,
//   enqueueV3, getTensorShape.
//
// Load refuses a plan with a binding that is not device-resident and linear. Each run selects the
// optimization profile that admits every input's shape (a decode + prefill plan runs either), and
// is refused, naming the binding, for an address not aligned to 256 bytes, an output larger than
// its buffer or with a data-dependent shape. TensorRT's own error messages end up in the Status.
// The blob's device is made current for the run and for the destruction, and the caller's given
// back after.
//
// Built only under --config=tensorrt with a TensorRT SDK ($TENSORRT_HOME); see README.md for what
// has been built and run. Linking //cc/engines/tensorrt:tensorrt_engine (alwayslink) registers the
// factory for blob::EngineKind::kTensorrt.
#pragma once

#include <memory>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"

namespace zerokv::engines {

Status CreateTensorRtEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                            std::unique_ptr<Engine>* engine);

}  // namespace zerokv::engines
