#include "cc/blob/blob.h"

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace zerokv::blob {
namespace {

std::string Quote(const std::string& name) { return "'" + name + "'"; }

std::string Range(uint64_t offset, uint64_t size) {
  return "[" + std::to_string(offset) + ", " + std::to_string(offset) + " + " + std::to_string(size) + ")";
}

std::optional<Error> ValidateHeader(const Header& header, uint64_t blob_length) {
  if (header.header_size != kHeaderSize) {
    return Refuse(ErrorCode::kBadHeader, "header.header_size",
                  std::to_string(header.header_size) + ", expected " + std::to_string(kHeaderSize));
  }
  if (header.reserved != 0) {
    return Refuse(ErrorCode::kBadHeader, "header.reserved", std::to_string(header.reserved) + ", must be 0");
  }
  if (header.device_id < 0) {
    return Refuse(ErrorCode::kBadHeader, "header.device_id", std::to_string(header.device_id) + " is negative");
  }
  if (header.blob_size != blob_length) {
    return Refuse(ErrorCode::kBadHeader, "header.blob_size",
                  "says " + std::to_string(header.blob_size) + " bytes, the blob holds " + std::to_string(blob_length));
  }
  struct Section {
    const char* name;
    uint64_t offset;
    uint64_t size;
  };
  const Section sections[] = {{"metadata", header.metadata_offset, header.metadata_size},
                              {"payload", header.payload_offset, header.payload_size}};
  for (const Section& section : sections) {
    // Written so that no sum can wrap: offset <= length first, then size against what is left.
    if (section.offset > blob_length || section.size > blob_length - section.offset) {
      return Refuse(ErrorCode::kOutOfRange, std::string("header.") + section.name + "_offset",
                    Range(section.offset, section.size) + " lies outside the " + std::to_string(blob_length) +
                        "-byte blob");
    }
  }
  for (const Section& section : sections) {
    if (section.offset < kHeaderSize && section.size > 0) {
      return Refuse(ErrorCode::kOverlap, std::string("header.") + section.name + "_offset",
                    std::to_string(section.offset) + " overlaps the " + std::to_string(kHeaderSize) + "-byte header");
    }
  }
  const Section& metadata = sections[0];
  const Section& payload = sections[1];
  if (metadata.offset < payload.offset + payload.size && payload.offset < metadata.offset + metadata.size) {
    return Refuse(ErrorCode::kOverlap, "header.payload_offset",
                  "payload " + Range(payload.offset, payload.size) + " overlaps metadata " +
                      Range(metadata.offset, metadata.size));
  }
  if (payload.offset % kPayloadAlignment != 0) {
    return Refuse(ErrorCode::kMisalignedPayload, "header.payload_offset",
                  std::to_string(payload.offset) + " is not a multiple of " + std::to_string(kPayloadAlignment));
  }
  return std::nullopt;
}

// The engine is the payload or a named data entry, never both; constants are placeable.
std::optional<Error> ValidateNamedData(const Metadata& metadata, uint64_t payload_size) {
  if (payload_size == 0 && metadata.engine_key.empty()) {
    return Refuse(ErrorCode::kOutOfRange, "header.payload_size",
                  "the engine payload is empty and metadata.engine_key names no named data entry");
  }
  if (payload_size != 0 && !metadata.engine_key.empty()) {
    return Refuse(ErrorCode::kBadNamedData, "metadata.engine_key",
                  Quote(metadata.engine_key) + ", but the engine is also the " + std::to_string(payload_size) +
                      "-byte payload");
  }
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < metadata.constants.size(); ++i) {
    const Constant& constant = metadata.constants[i];
    const std::string field = "metadata.constants[" + std::to_string(i) + "]";
    if (!names.insert(constant.name).second) {
      return Refuse(ErrorCode::kBadNamedData, field + ".name", Quote(constant.name) + " is already a constant");
    }
    if (constant.strides.size() != constant.sizes.size()) {
      return Refuse(ErrorCode::kBadNamedData, field + ".strides",
                    std::to_string(constant.strides.size()) + " strides for the " +
                        std::to_string(constant.sizes.size()) + " sizes of " + Quote(constant.name));
    }
    const std::pair<const char*, const std::vector<int64_t>*> roles[] = {{"sizes", &constant.sizes},
                                                                         {"strides", &constant.strides}};
    for (const auto& [role, extents] : roles) {
      for (size_t d = 0; d < extents->size(); ++d) {
        if ((*extents)[d] < 0) {
          return Refuse(ErrorCode::kBadNamedData, field + "." + role + "[" + std::to_string(d) + "]",
                        std::to_string((*extents)[d]) + " is negative in " + Quote(constant.name));
        }
      }
    }
    if (constant.storage_offset < 0) {
      return Refuse(ErrorCode::kBadNamedData, field + ".storage_offset",
                    std::to_string(constant.storage_offset) + " is negative in " + Quote(constant.name));
    }
  }
  return std::nullopt;
}

bool SameShape(const std::vector<Dim>& a, const std::vector<Dim>& b) { return a == b; }

// positions_binding and the ring layers' slots_binding: integer argument inputs the runtime fills
// (from format version 2; a version 1 model reads the positions its caller gives).
std::optional<Error> ValidateRuntimeIndices(const Metadata& metadata,
                                            const std::unordered_map<std::string, const IOBinding*>& bindings,
                                            const std::unordered_set<std::string>& runtime_owned,
                                            uint16_t format_version) {
  auto check = [&](const std::string& name, const std::string& field) -> std::optional<Error> {
    auto found = bindings.find(name);
    if (found == bindings.end() || found->second->direction != Direction::kInput || runtime_owned.count(name) != 0) {
      return Refuse(ErrorCode::kBadPositionsBinding, field, Quote(name) + " is not a delegate argument input");
    }
    const DType dtype = found->second->dtype;
    if (dtype != DType::kInt32 && dtype != DType::kInt64) {
      return Refuse(ErrorCode::kBadPositionsBinding, field,
                    Quote(name) + " is " + ToString(dtype) + ", not INT32 or INT64");
    }
    return std::nullopt;
  };
  const std::string& positions = metadata.positions_binding;
  const char* positions_field = "metadata.positions_binding";
  if (metadata.kv_layers.empty()) {
    if (!positions.empty()) {
      return Refuse(ErrorCode::kBadPositionsBinding, positions_field, Quote(positions) + " without a KV manifest");
    }
    return std::nullopt;
  }
  if (format_version < 2) return std::nullopt;
  if (positions.empty()) {
    return Refuse(ErrorCode::kBadPositionsBinding, positions_field,
                  "empty, but the runtime supplies the positions of every step over runtime-owned caches");
  }
  if (std::optional<Error> error = check(positions, positions_field)) return error;
  std::unordered_map<std::string, uint64_t> windows;
  for (size_t i = 0; i < metadata.kv_layers.size(); ++i) {
    const KVLayer& layer = metadata.kv_layers[i];
    const std::string field = "metadata.kv_layers[" + std::to_string(i) + "].slots_binding";
    const std::string& slots = layer.slots_binding;
    if (layer.policy == KVPolicy::kFlat) {
      if (!slots.empty()) return Refuse(ErrorCode::kBadPositionsBinding, field, Quote(slots) + " on a flat cache");
      continue;
    }
    if (slots.empty()) {
      return Refuse(ErrorCode::kBadPositionsBinding, field, "empty, but the runtime supplies a ring cache's write slots");
    }
    if (slots == positions) {
      return Refuse(ErrorCode::kBadPositionsBinding, field, Quote(slots) + " is positions_binding too");
    }
    if (std::optional<Error> error = check(slots, field)) return error;
    auto window = windows.emplace(slots, layer.window).first;
    if (window->second != layer.window) {
      return Refuse(ErrorCode::kBadPositionsBinding, field,
                    Quote(slots) + " serves ring caches of windows " + std::to_string(window->second) + " and " +
                        std::to_string(layer.window));
    }
  }
  return std::nullopt;
}

std::optional<Error> ValidateMetadata(const Metadata& metadata, bool aliased_outputs_elided, uint16_t format_version) {
  std::unordered_map<std::string, const IOBinding*> bindings;
  for (size_t i = 0; i < metadata.bindings.size(); ++i) {
    const IOBinding& binding = metadata.bindings[i];
    const std::string field = "metadata.bindings[" + std::to_string(i) + "]";
    for (size_t d = 0; d < binding.shape.size(); ++d) {
      const Dim& dim = binding.shape[d];
      if (dim.min < 0 || dim.max < -1 || (dim.max != -1 && dim.max < dim.min)) {
        return Refuse(ErrorCode::kBadShape, field + ".shape[" + std::to_string(d) + "]",
                      "bounds [" + std::to_string(dim.min) + ", " + std::to_string(dim.max) + "] of " +
                          Quote(binding.name));
      }
    }
    if (!bindings.emplace(binding.name, &binding).second) {
      return Refuse(ErrorCode::kDuplicateBinding, field + ".name", Quote(binding.name) + " is already a binding");
    }
  }
  auto find = [&](const std::string& name, Direction direction) -> const IOBinding* {
    auto it = bindings.find(name);
    return it != bindings.end() && it->second->direction == direction ? it->second : nullptr;
  };

  std::unordered_set<std::string> aliased_outputs, aliased_inputs;
  for (size_t i = 0; i < metadata.aliased_io.size(); ++i) {
    const AliasedIO& alias = metadata.aliased_io[i];
    const std::string field = "metadata.aliased_io[" + std::to_string(i) + "]";
    const IOBinding* output = find(alias.output, Direction::kOutput);
    const IOBinding* input = find(alias.input, Direction::kInput);
    if (output == nullptr) {
      return Refuse(ErrorCode::kUnknownAliasBinding, field + ".output", Quote(alias.output) + " is not an output binding");
    }
    if (input == nullptr) {
      return Refuse(ErrorCode::kUnknownAliasBinding, field + ".input", Quote(alias.input) + " is not an input binding");
    }
    if (!aliased_outputs.insert(alias.output).second) {
      return Refuse(ErrorCode::kDuplicateAlias, field + ".output", Quote(alias.output) + " is already aliased");
    }
    if (!aliased_inputs.insert(alias.input).second) {
      return Refuse(ErrorCode::kDuplicateAlias, field + ".input", Quote(alias.input) + " is already the target of an alias");
    }
    if (output->dtype != input->dtype || output->device != input->device || !SameShape(output->shape, input->shape)) {
      return Refuse(ErrorCode::kAliasMismatch, field,
                    Quote(alias.output) + " and " + Quote(alias.input) + " differ in dtype, device or shape");
    }
  }
  if (aliased_outputs_elided && metadata.aliased_io.empty()) {
    return Refuse(ErrorCode::kElisionWithoutAliases, "header.aliased_outputs_elided", "set, but aliased_io is empty");
  }

  std::unordered_set<std::string> runtime_owned, storage_keys;
  for (size_t i = 0; i < metadata.kv_layers.size(); ++i) {
    const KVLayer& layer = metadata.kv_layers[i];
    const std::string field = "metadata.kv_layers[" + std::to_string(i) + "]";
    if (!storage_keys.insert(layer.storage_key).second) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".storage_key", Quote(layer.storage_key) + " names another layer too");
    }
    const std::pair<const char*, const std::string*> roles[] = {{"k_binding", &layer.k_binding},
                                                                {"v_binding", &layer.v_binding}};
    for (const auto& [role, name] : roles) {
      const IOBinding* binding = find(*name, Direction::kInput);
      if (binding == nullptr) {
        return Refuse(ErrorCode::kBadKvManifest, field + "." + role, Quote(*name) + " is not an input binding");
      }
      if (!runtime_owned.insert(*name).second) {
        return Refuse(ErrorCode::kBadKvManifest, field + "." + role, Quote(*name) + " is already a runtime-owned cache");
      }
      if (binding->dtype != layer.dtype) {
        return Refuse(ErrorCode::kBadKvManifest, field + ".dtype",
                      std::string(ToString(layer.dtype)) + ", but binding " + Quote(*name) + " is " +
                          ToString(binding->dtype));
      }
      const std::vector<Dim>& dims = binding->shape;
      const auto heads = static_cast<int64_t>(layer.heads);
      const auto head_dim = static_cast<int64_t>(layer.head_dim);
      if (dims.size() != 4 || dims[1].min != heads || dims[1].max != heads || dims[3].min != head_dim ||
          dims[3].max != head_dim) {
        return Refuse(ErrorCode::kBadKvManifest, field + "." + role,
                      Quote(*name) + " is not [batch, " + std::to_string(layer.heads) + " heads, positions, " +
                          std::to_string(layer.head_dim) + "]");
      }
    }
    if (layer.heads == 0 || layer.head_dim == 0) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".heads", "heads and head_dim must be positive");
    }
    if (layer.policy == KVPolicy::kRing && layer.window == 0) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".window", "a ring cache needs a window");
    }
    if (layer.policy == KVPolicy::kFlat && layer.window != 0) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".window", std::to_string(layer.window) + " on a flat cache");
    }
    if (layer.initial_capacity == 0 || layer.initial_capacity > layer.max_capacity) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".initial_capacity",
                    "needs 0 < initial_capacity (" + std::to_string(layer.initial_capacity) + ") <= max_capacity (" +
                        std::to_string(layer.max_capacity) + ")");
    }
    if (layer.policy == KVPolicy::kRing && layer.window > layer.max_capacity) {
      return Refuse(ErrorCode::kBadKvManifest, field + ".window",
                    "window " + std::to_string(layer.window) + " exceeds max_capacity " +
                        std::to_string(layer.max_capacity));
    }
  }
  for (size_t i = 0; i < metadata.aliased_io.size(); ++i) {
    const AliasedIO& alias = metadata.aliased_io[i];
    if (runtime_owned.count(alias.input) != 0 && alias.kind != AliasKind::kKvCacheUpdate) {
      return Refuse(ErrorCode::kBadKvManifest, "metadata.aliased_io[" + std::to_string(i) + "].kind",
                    Quote(alias.input) + " is runtime-owned, so its alias must be kv_cache_update");
    }
  }

  if (std::optional<Error> error = ValidateRuntimeIndices(metadata, bindings, runtime_owned, format_version)) {
    return error;
  }
  const std::string& source = metadata.step_width_source;
  const char* source_field = "metadata.step_width_source";
  if (metadata.kv_layers.empty()) {
    if (!source.empty()) {
      return Refuse(ErrorCode::kBadStepWidthSource, source_field, Quote(source) + " without a KV manifest");
    }
    return std::nullopt;
  }
  const std::optional<StepWidthSource> parsed = ParseStepWidthSource(source);
  if (!parsed) {
    return Refuse(ErrorCode::kBadStepWidthSource, source_field, Quote(source) + " is not 'input_index:dim'");
  }
  const uint64_t input_index = parsed->input_index, dim = parsed->dim;
  const DelegateSignature signature = ComputeDelegateSignature(metadata, aliased_outputs_elided);
  if (input_index >= signature.inputs.size()) {
    return Refuse(ErrorCode::kBadStepWidthSource, source_field,
                  "input " + std::to_string(input_index) + ", but the delegate takes " +
                      std::to_string(signature.inputs.size()) + " inputs");
  }
  const IOBinding& binding = metadata.bindings[signature.inputs[input_index]];
  if (dim >= binding.shape.size()) {
    return Refuse(ErrorCode::kBadStepWidthSource, source_field,
                  "dim " + std::to_string(dim) + " of " + Quote(binding.name) + ", which has rank " +
                      std::to_string(binding.shape.size()));
  }
  return std::nullopt;
}

}  // namespace

std::optional<StepWidthSource> ParseStepWidthSource(const std::string& source) {
  const size_t colon = source.find(':');
  if (colon == std::string::npos) return std::nullopt;
  auto parse_number = [](const std::string& text, uint64_t* value) {
    if (text.empty() || text.size() > 9 || (text.size() > 1 && text[0] == '0')) return false;
    *value = 0;
    for (char c : text) {
      if (c < '0' || c > '9') return false;
      *value = *value * 10 + static_cast<uint64_t>(c - '0');
    }
    return true;
  };
  StepWidthSource parsed;
  if (!parse_number(source.substr(0, colon), &parsed.input_index) ||
      !parse_number(source.substr(colon + 1), &parsed.dim)) {
    return std::nullopt;
  }
  return parsed;
}

DelegateSignature ComputeDelegateSignature(const Metadata& metadata, bool aliased_outputs_elided) {
  std::unordered_set<std::string> runtime_owned;
  for (const KVLayer& layer : metadata.kv_layers) {
    runtime_owned.insert(layer.k_binding);
    runtime_owned.insert(layer.v_binding);
  }
  std::unordered_map<std::string, std::string> aliased;  // output -> input
  for (const AliasedIO& alias : metadata.aliased_io) aliased.emplace(alias.output, alias.input);

  DelegateSignature signature;
  for (size_t i = 0; i < metadata.bindings.size(); ++i) {
    const IOBinding& binding = metadata.bindings[i];
    if (binding.direction == Direction::kInput) {
      if (runtime_owned.count(binding.name) == 0) signature.inputs.push_back(i);
      continue;
    }
    auto alias = aliased.find(binding.name);
    if (alias == aliased.end() || (runtime_owned.count(alias->second) == 0 && !aliased_outputs_elided)) {
      signature.outputs.push_back(i);
    }
  }
  return signature;
}

std::optional<Error> Parse(const uint8_t* data, size_t size, Blob* blob) {
  Header header;
  std::optional<Error> error;
  if (!ReadHeader(data, size, &header, &error)) return error;
  if ((error = ValidateHeader(header, size))) return error;
  Metadata metadata;
  if (!DecodeMetadata(data + header.metadata_offset, header.metadata_size, header.format_version, &metadata,
                      &error)) {
    return error;
  }
  if ((error = ValidateNamedData(metadata, header.payload_size))) return error;
  if ((error = ValidateMetadata(metadata, header.aliased_outputs_elided, header.format_version))) return error;
  blob->engine_kind = header.engine_kind;
  blob->device_id = header.device_id;
  blob->aliased_outputs_elided = header.aliased_outputs_elided;
  blob->metadata = std::move(metadata);
  blob->payload = data + header.payload_offset;
  blob->payload_size = header.payload_size;
  blob->format_version = header.format_version;
  return std::nullopt;
}

std::optional<Error> Serialize(const Blob& blob, std::vector<uint8_t>* out) {
  std::vector<uint8_t> metadata;
  std::optional<Error> error;
  if (!EncodeMetadata(blob.metadata, blob.format_version, &metadata, &error)) return error;

  Header header;
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.format_version = blob.format_version;
  header.header_size = kHeaderSize;
  header.engine_kind = blob.engine_kind;
  header.aliased_outputs_elided = blob.aliased_outputs_elided;
  header.device_id = blob.device_id;
  header.metadata_offset = kHeaderSize;
  header.metadata_size = metadata.size();
  header.payload_offset = (kHeaderSize + metadata.size() + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment;
  header.payload_size = blob.payload_size;
  header.blob_size = header.payload_offset + blob.payload_size;
  if ((error = ValidateHeader(header, header.blob_size))) return error;
  if ((error = ValidateNamedData(blob.metadata, header.payload_size))) return error;
  if ((error = ValidateMetadata(blob.metadata, blob.aliased_outputs_elided, blob.format_version))) return error;

  Writer writer;
  WriteHeader(writer, header);
  std::vector<uint8_t>& bytes = writer.bytes();
  bytes.insert(bytes.end(), metadata.begin(), metadata.end());
  bytes.resize(header.payload_offset, 0);
  bytes.insert(bytes.end(), blob.payload, blob.payload + blob.payload_size);
  *out = std::move(bytes);
  return std::nullopt;
}

std::optional<int8_t> ScalarTypeCode(DType dtype) {
  // c10's ScalarType numbering (ExecuTorch's ScalarType uses the same).
  switch (dtype) {
    case DType::kFloat32:
      return 6;
    case DType::kFloat16:
      return 5;
    case DType::kBfloat16:
      return 15;
    case DType::kInt32:
      return 3;
    case DType::kInt64:
      return 4;
    case DType::kInt8:
      return 1;
    case DType::kUint8:
      return 0;
    case DType::kBool:
      return 11;
  }
  return std::nullopt;
}

}  // namespace zerokv::blob
