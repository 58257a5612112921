#include "cc/runtime/backend.h"

#include <memory>
#include <string>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/log.h>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/device_ops.h"

namespace zerokv::runtime {
namespace {

using base::InvalidProgram;

using executorch::runtime::ArrayRef;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::CompileSpec;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Result;
using executorch::runtime::Span;

Error Report(const char* method, const Status& status) {
  ET_LOG(Error, "ZeroKVBackend (method '%s'): %s", method ? method : "?",
         status.message().c_str());
  return status.code();
}

class ZeroKVBackend final : public executorch::runtime::BackendInterface {
 public:
  bool is_available() const override { return true; }

  Result<DelegateHandle*> init(BackendInitContext& context, FreeableBuffer* processed,
                               ArrayRef<CompileSpec>) const override {
    blob::Blob parsed;
    if (std::optional<blob::Error> error = blob::Parse(
            static_cast<const uint8_t*>(processed->data()), processed->size(), &parsed)) {
      return Report(context.get_method_name(),
                    InvalidProgram("the delegate blob is invalid: " + error->message));
    }
    std::unique_ptr<engines::Engine> engine;
    Status status = engines::CreateEngine(parsed, context.get_named_data_map(), &engine);
    std::unique_ptr<DeviceOps> ops;
    if (status.ok()) status = MakeDeviceOps(engine->compute_device(), parsed.device_id, &ops);
    std::unique_ptr<Delegate> delegate;
    const char* method = context.get_method_name();
    if (status.ok()) {
      status = Delegate::Create(parsed, std::move(engine), std::move(ops), method ? method : "",
                                &delegate);
    }
    if (!status.ok()) return Report(context.get_method_name(), status);
    // The engine holds what it needs of the payload and of the named data; the blob's bytes can go.
    processed->Free();
    return static_cast<DelegateHandle*>(delegate.release());
  }

  Error execute(BackendExecutionContext& context, DelegateHandle* handle,
                Span<EValue*> args) const override {
    Status status = static_cast<Delegate*>(handle)->Execute(args);
    if (!status.ok()) return Report(context.get_method_name(), status);
    return Error::Ok;
  }

  void destroy(DelegateHandle* handle) const override { delete static_cast<Delegate*>(handle); }
};

ZeroKVBackend backend;
const Error registered = executorch::runtime::register_backend({kBackendName, &backend});

}  // namespace
}  // namespace zerokv::runtime
