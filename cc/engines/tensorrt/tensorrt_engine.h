// The TensorRT engine kind: a thin adapter over the TensorRT C++ runtime API. The blob's payload
// is a serialized engine (plan); bindings, shapes and aliases are TensorRT's own:
//   deserializeCudaEngine, getIOTensorName/getTensorIOMode/getTensorDataType,
//   getAliasedInputTensor, setInputShape, setTensorAddress, enqueueV3, getTensorShape.
//
// Built only under --config=tensorrt with a TensorRT SDK ($TENSORRT_HOME); see README.md for what
// has been built and run. Linking //cc/engines/tensorrt:tensorrt_engine (alwayslink) registers the
// factory for blob::EngineKind::kTensorrt.
#pragma once

#include <memory>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"

namespace zerokv::engines {

Status CreateTensorRtEngine(const blob::Blob& blob, std::unique_ptr<Engine>* engine);

}  // namespace zerokv::engines
