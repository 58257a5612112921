// zerokv delegate blobs: parse and write them, enforcing every rule of the format.
//
// The byte layout is generated from tools/blob_schema/schema.py into blob_format.h; this header
// adds the rules that tie fields together. py/zerokv/blob/codec.py enforces the same rules with the
// same error codes.
//
//   Blob blob;
//   if (std::optional<Error> error = Parse(data, size, &blob)) { ... error->code, error->message ... }
//
// Parse never reads outside [data, data + size) and never trusts a count or an offset before
// checking it against the bytes that are there. Every refusal names the field at fault. It reads
// every format version up to kFormatVersion (tools/blob_schema/schema.py says how they evolve).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cc/blob/blob_format.h"

namespace zerokv::blob {

struct Blob {
  EngineKind engine_kind = EngineKind::kAoti;
  int32_t device_id = 0;
  // The aliased outputs (of caller-owned inputs) are not delegate arguments: the engine's write
  // through the aliased input is the buffer update. Recorded, never inferred from an argument count.
  bool aliased_outputs_elided = false;
  Metadata metadata;
  // The engine code (empty when metadata.engine_key names the engine's named data entry). After
  // Parse, a view into the parsed bytes, which must outlive the Blob.
  const uint8_t* payload = nullptr;
  size_t payload_size = 0;
  // The version the blob was written in (Parse), or is to be written in (Serialize).
  uint16_t format_version = kFormatVersion;
};

// Which bindings are delegate arguments, in argument order (indices into metadata.bindings): the
// inputs, then the outputs. Runtime-owned KV inputs are never arguments, nor are outputs aliased
// to them; other aliased outputs are arguments unless the blob records them as elided.
struct DelegateSignature {
  std::vector<size_t> inputs;
  std::vector<size_t> outputs;
  size_t arity() const { return inputs.size() + outputs.size(); }
};

// The PyTorch ScalarType code of `dtype`, which c10::ScalarType and ExecuTorch's ScalarType share
// (static_cast to either); nullopt if `dtype` is not a DType. Sizes are the schema's
// (ElementBytes, generated into blob_format.h).
std::optional<int8_t> ScalarTypeCode(DType dtype);

DelegateSignature ComputeDelegateSignature(const Metadata& metadata, bool aliased_outputs_elided);

// metadata.step_width_source: the delegate's argument input `input_index` (an index into
// DelegateSignature::inputs) whose extent along `dim` is the number of tokens a step writes.
struct StepWidthSource {
  uint64_t input_index = 0;
  uint64_t dim = 0;
};

// Parses "input_index:dim" (decimals of at most 9 digits, no leading zeros); nullopt if malformed.
// A parsed blob's source is well-formed and in range whenever it has kv_layers.
std::optional<StepWidthSource> ParseStepWidthSource(const std::string& source);

// Parses and validates `data`. On success fills `blob` and returns nullopt.
std::optional<Error> Parse(const uint8_t* data, size_t size, Blob* blob);

// Writes `blob` (header, metadata, padding, payload) in blob.format_version into `out`, or returns
// why it is invalid or cannot be written in that version: nothing invalid is ever written.
std::optional<Error> Serialize(const Blob& blob, std::vector<uint8_t>* out);

}  // namespace zerokv::blob
