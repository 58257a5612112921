#include "cc/engines/engine.h"

#include <map>
#include <string>
#include <utility>

namespace zerokv::engines {
namespace {

std::map<blob::EngineKind, EngineFactory>& Factories() {
  static auto* factories = new std::map<blob::EngineKind, EngineFactory>();
  return *factories;
}

}  // namespace

bool RegisterEngineFactory(blob::EngineKind kind, EngineFactory factory) {
  return Factories().emplace(kind, std::move(factory)).second;
}

Status CreateEngine(const blob::Blob& blob, const NamedDataMap* named_data, std::unique_ptr<Engine>* engine) {
  auto factory = Factories().find(blob.engine_kind);
  if (factory == Factories().end()) {
    return base::NotSupported(std::string("the blob's engine kind ") +
                                 blob::ToString(blob.engine_kind) +
                                 " is not linked into this runtime (its engine library is absent)");
  }
  return factory->second(blob, named_data, engine);
}

Status GetNamedData(const NamedDataMap* named_data, const std::string& key, const std::string& what,
                    std::optional<FreeableBuffer>* data) {
  if (named_data == nullptr) {
    return base::InvalidProgram(what + " is named data entry '" + key +
                                   "', but the program has no named data: load the .ptd written "
                                   "beside the .pte with it");
  }
  executorch::runtime::Result<FreeableBuffer> found = named_data->get_data(key);
  if (!found.ok()) {
    return base::InvalidProgram(what + " is named data entry '" + key +
                                   "', which the program's named data does not hold: is the .ptd "
                                   "loaded with the .pte the one saved with it?");
  }
  data->emplace(std::move(found.get()));
  return Status::Ok();
}

}  // namespace zerokv::engines
