#include "cc/engines/engine.h"

#include <map>
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

Status CreateEngine(const blob::Blob& blob, std::unique_ptr<Engine>* engine) {
  auto factory = Factories().find(blob.engine_kind);
  if (factory == Factories().end()) {
    return base::NotSupported(std::string("the blob's engine kind ") +
                                 blob::ToString(blob.engine_kind) +
                                 " is not linked into this runtime (its engine library is absent)");
  }
  return factory->second(blob, engine);
}

}  // namespace zerokv::engines
