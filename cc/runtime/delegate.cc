#include "cc/runtime/delegate.h"

#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>

#include "cc/runtime/binding_trace.h"
#include "cc/runtime/caller_stream.h"

namespace zerokv::runtime {

using base::InvalidArgument;
using base::InvalidProgram;
using base::InvalidState;

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::Span;
using executorch::runtime::etensor::DeviceType;

namespace {

std::string Quote(const std::string& name) { return "'" + name + "'"; }

std::optional<ScalarType> ToScalarType(blob::DType dtype) {
  std::optional<int8_t> code = blob::ScalarTypeCode(dtype);
  if (!code) return std::nullopt;
  return static_cast<ScalarType>(*code);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::vector<int64_t> ShapeOf(const Tensor& tensor) {
  return std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end());
}

std::vector<int64_t> MaxShape(const blob::IOBinding& binding) {
  std::vector<int64_t> shape;
  for (const blob::Dim& dim : binding.shape) shape.push_back(dim.max);
  return shape;
}

Status Resize(Tensor& tensor, const std::vector<int64_t>& shape) {
  std::vector<SizesType> sizes(shape.begin(), shape.end());
  executorch::runtime::Error error = executorch::runtime::resize_tensor(
      tensor, executorch::runtime::ArrayRef<SizesType>(sizes.data(), sizes.size()));
  if (error != executorch::runtime::Error::Ok) {
    return Status(error, "cannot be resized to " + ShapeString(shape) +
                             " (larger than the memory ExecuTorch planned for it?)");
  }
  return Status::Ok();
}

}  // namespace

// What Validate decided for each argument, indexed like bindings_.
struct Delegate::Plan {
  std::vector<Tensor*> tensors;  // the argument's tensor; nullptr for an elided output
  std::vector<bool> staged;
  // Finish the stream before returning: host outputs, page-locked host inputs, or our own stream.
  bool synchronize = false;
  uint64_t step = 0;      // tokens this execute writes into the runtime-owned caches
  uint64_t position = 0;  // the first of them: the caches' committed position count
};

Delegate::Delegate(std::unique_ptr<engines::Engine> engine, std::shared_ptr<DeviceOps> ops)
    : engine_(std::move(engine)), ops_(std::move(ops)) {}

Status Delegate::Create(const blob::Blob& blob, std::unique_ptr<engines::Engine> engine,
                        std::unique_ptr<DeviceOps> ops, const std::string& method,
                        std::unique_ptr<Delegate>* delegate) {
  const blob::Metadata& metadata = blob.metadata;
  // The engine's bindings and the blob's must be the same set, with the same direction and dtype.
  std::unordered_map<std::string, const engines::EngineBinding*> engine_bindings;
  for (const engines::EngineBinding& binding : engine->bindings()) {
    engine_bindings.emplace(binding.name, &binding);
  }
  if (engine_bindings.size() != metadata.bindings.size()) {
    return InvalidProgram("the engine has " + std::to_string(engine_bindings.size()) +
                          " I/O bindings but the blob records " +
                          std::to_string(metadata.bindings.size()));
  }
  std::unordered_map<std::string, size_t> index_of;
  for (size_t i = 0; i < metadata.bindings.size(); ++i) {
    const blob::IOBinding& binding = metadata.bindings[i];
    auto found = engine_bindings.find(binding.name);
    if (found == engine_bindings.end()) {
      return InvalidProgram("the blob records binding " + Quote(binding.name) +
                            ", which the engine does not have");
    }
    if (found->second->direction != binding.direction || found->second->dtype != binding.dtype) {
      return InvalidProgram("binding " + Quote(binding.name) + " is " +
                            blob::ToString(binding.direction) + " " +
                            blob::ToString(binding.dtype) + " in the blob but " +
                            blob::ToString(found->second->direction) + " " +
                            blob::ToString(found->second->dtype) + " in the engine");
    }
    if (!ToScalarType(binding.dtype)) {
      return InvalidProgram("binding " + Quote(binding.name) + " has an unsupported dtype");
    }
    index_of.emplace(binding.name, i);
  }

  std::unique_ptr<Delegate> created(new Delegate(std::move(engine), std::move(ops)));
  created->method_ = method;
  created->device_id_ = blob.device_id;
  created->aliased_outputs_elided_ = blob.aliased_outputs_elided;
  for (const blob::IOBinding& spec : metadata.bindings) {
    Binding binding;
    binding.spec = spec;
    binding.max_bytes = blob::ElementBytes(spec.dtype);
    for (const blob::Dim& dim : spec.shape) {
      size_t bytes = 0;
      if (!binding.max_bytes || dim.max < 0 ||
          __builtin_mul_overflow(*binding.max_bytes, static_cast<size_t>(dim.max), &bytes)) {
        binding.max_bytes.reset();
      } else {
        binding.max_bytes = bytes;
      }
    }
    created->bindings_.push_back(std::move(binding));
  }

  // Every alias the blob records must be one the engine reports, and the other way round: an
  // engine alias missing from the blob would overwrite a caller buffer nobody expects to change.
  for (const blob::AliasedIO& alias : metadata.aliased_io) {
    auto output = index_of.find(alias.output);
    auto input = index_of.find(alias.input);
    if (output == index_of.end() || input == index_of.end() ||
        metadata.bindings[output->second].direction != blob::Direction::kOutput ||
        metadata.bindings[input->second].direction != blob::Direction::kInput) {
      return InvalidProgram("aliased_io entry " + Quote(alias.output) + " -> " +
                            Quote(alias.input) + " does not name an output and an input");
    }
    Binding& aliased_output = created->bindings_[output->second];
    if (aliased_output.aliased_input) {
      return InvalidProgram("output " + Quote(alias.output) +
                            " is aliased twice in aliased_io; the delegate's arity would be wrong");
    }
    std::optional<std::string> engine_input = created->engine_->AliasedInput(alias.output);
    if (engine_input != alias.input) {
      return InvalidProgram("the blob aliases output " + Quote(alias.output) + " to input " +
                            Quote(alias.input) + ", but the engine " +
                            (engine_input ? "aliases it to " + Quote(*engine_input)
                                          : std::string("does not alias it")));
    }
    if (aliased_output.max_bytes != created->bindings_[input->second].max_bytes) {
      return InvalidProgram("aliased output " + Quote(alias.output) + " and its input " +
                            Quote(alias.input) + " differ in size");
    }
    aliased_output.aliased_input = input->second;
    created->bindings_[input->second].alias_target = true;
  }
  for (const Binding& binding : created->bindings_) {
    if (binding.spec.direction != blob::Direction::kOutput || binding.aliased_input) continue;
    if (std::optional<std::string> input = created->engine_->AliasedInput(binding.spec.name)) {
      return InvalidProgram("the engine writes output " + Quote(binding.spec.name) +
                            " through input " + Quote(*input) +
                            ", but the blob records no such alias: the caller's " + Quote(*input) +
                            " would change without anyone expecting it");
    }
  }

  // The recorded elision decides the arity (blob::ComputeDelegateSignature is the one place it is
  // computed). Elided outputs are never written by this runtime, so each must be aliased.
  created->signature_ = blob::ComputeDelegateSignature(metadata, blob.aliased_outputs_elided);
  size_t argument = 0;
  for (size_t index : created->signature_.inputs) created->bindings_[index].argument = argument++;
  for (size_t index : created->signature_.outputs) created->bindings_[index].argument = argument++;
  ZEROKV_RETURN_IF_ERROR(created->PlanCaches(blob, index_of));
  for (const Binding& binding : created->bindings_) {
    if (!binding.argument && !binding.aliased_input && !binding.layer) {
      return InvalidProgram("binding " + Quote(binding.spec.name) +
                            " is neither a delegate argument, an aliased output nor a "
                            "runtime-owned cache");
    }
  }

  if (created->engine_->compute_device() == base::ComputeDevice::kCuda) {
    ZEROKV_RETURN_IF_ERROR(created->ops_->CreateStream(&created->own_stream_));
    ZEROKV_RETURN_IF_ERROR(created->ops_->CreateEvent(&created->done_event_));
  }
  ZEROKV_RETURN_IF_ERROR(created->ops_->Allocate(256, &created->empty_tensor_address_));
  for (Binding& binding : created->bindings_) {
    if (binding.positions_modulo) ZEROKV_RETURN_IF_ERROR(created->EnsureStaging(binding));
  }
  *delegate = std::move(created);
  return Status::Ok();
}

// The parser has checked the manifest against the blob's bindings (inputs, dtype, rank 4 with the
// layer's heads and head_dim, capacities, the step width source, the positions and slots bindings:
// integer argument inputs); what is left is what the runtime binds: a static batch and a positions
// dim admitting every capacity the cache may take, and bounded positions and slots.
Status Delegate::PlanCaches(const blob::Blob& blob,
                            const std::unordered_map<std::string, size_t>& index_of) {
  const blob::Metadata& metadata = blob.metadata;
  if (metadata.kv_layers.empty()) return Status::Ok();
  // Well-formed and in range: the parser refused the blob otherwise.
  const blob::StepWidthSource source = *blob::ParseStepWidthSource(metadata.step_width_source);
  step_binding_ = signature_.inputs[source.input_index];
  step_dim_ = source.dim;
  auto fill_with_positions = [&](const std::string& name, uint64_t modulo) -> Status {
    if (name.empty()) return Status::Ok();  // format version 1: the model reads its caller's positions
    Binding& binding = bindings_[index_of.at(name)];
    for (size_t d = 0; d < binding.spec.shape.size(); ++d) {
      if (binding.spec.shape[d].max == -1) {
        return InvalidProgram("input " + Quote(name) + " has an unbounded dim " + std::to_string(d) +
                              ": the runtime fills it with the step's positions in a buffer of its "
                              "own, sized for the largest shape; export it with a bounded dim");
      }
    }
    binding.positions_modulo = modulo;
    return Status::Ok();
  };
  ZEROKV_RETURN_IF_ERROR(fill_with_positions(metadata.positions_binding, 0));

  for (const blob::KVLayer& layer : metadata.kv_layers) {
    const bool ring = layer.policy == blob::KVPolicy::kRing;
    if (ring) ZEROKV_RETURN_IF_ERROR(fill_with_positions(layer.slots_binding, layer.window));
    // The capacities the storage can take: the window, or initial_capacity doubling up to max.
    const int64_t least = static_cast<int64_t>(ring ? layer.window : layer.initial_capacity);
    const int64_t most = static_cast<int64_t>(ring ? layer.window : layer.max_capacity);
    kvcache::KVCacheConfig config;
    config.dtype = layer.dtype;
    config.heads = layer.heads;
    config.head_dim = layer.head_dim;
    config.policy = layer.policy;
    config.window = layer.window;
    config.initial_capacity = layer.initial_capacity;
    config.max_capacity = layer.max_capacity;
    config.device = engine_->compute_device();
    config.device_id = blob.device_id;
    std::optional<int64_t> batch;
    for (const std::string* name : {&layer.k_binding, &layer.v_binding}) {
      const blob::IOBinding& spec = bindings_[index_of.at(*name)].spec;
      const std::string what = "runtime-owned cache " + Quote(*name) + " (KV storage " +
                               Quote(layer.storage_key) + ")";
      const blob::Dim& batch_dim = spec.shape[0];
      const blob::Dim& positions = spec.shape[2];
      if (batch_dim.min != batch_dim.max || batch_dim.min <= 0) {
        return InvalidProgram(what + " needs a static positive batch, the blob has [" +
                              std::to_string(batch_dim.min) + ", " +
                              std::to_string(batch_dim.max) + "]");
      }
      if (batch && *batch != batch_dim.min) {
        return InvalidProgram(what + " has batch " + std::to_string(batch_dim.min) +
                              ", its K binding " + std::to_string(*batch));
      }
      batch = batch_dim.min;
      if (positions.min > least || (positions.max != -1 && positions.max < most)) {
        return InvalidProgram(what + " is bound at every capacity in [" + std::to_string(least) +
                              ", " + std::to_string(most) + "] positions, but the engine's " +
                              "positions dim (2) admits [" + std::to_string(positions.min) + ", " +
                              std::to_string(positions.max) +
                              "]: compile it with a dynamic positions dim covering the capacities");
      }
    }
    config.batch = static_cast<uint64_t>(*batch);
    bindings_[index_of.at(layer.k_binding)].layer = layers_.size();
    Binding& value = bindings_[index_of.at(layer.v_binding)];
    value.layer = layers_.size();
    value.cache_value = true;
    layers_.push_back(Layer{layer.storage_key, config});
  }

  // At home in the sequence current at load, or the implicit one; the layouts are checked there now.
  std::shared_ptr<kvcache::Sequence> home = kvcache::CurrentSequence();
  home_ = home ? std::move(home) : kvcache::Sequence::Implicit();
  for (size_t i = 0; i < layers_.size(); ++i) {
    Status claimed = home_->Claim(method_, layers_[i].storage_key);
    if (!claimed.ok()) {
      for (size_t j = 0; j < i; ++j) home_->Release(method_, layers_[j].storage_key);
      layers_.resize(i);  // what the destructor releases
      return claimed;
    }
  }
  return UseSequence(home_);
}

Status Delegate::UseSequence(const std::shared_ptr<kvcache::Sequence>& sequence) {
  if (sequence->id() == sequence_id_) return Status::Ok();
  std::vector<std::shared_ptr<kvcache::KVCache>> caches(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    ZEROKV_RETURN_IF_ERROR(
        sequence->Acquire(layers_[i].storage_key, layers_[i].config, ops_, &caches[i]));
  }
  caches_ = std::move(caches);
  sequence_id_ = sequence->id();
  return Status::Ok();
}

Delegate::~Delegate() {
  Status drained = Drain();
  (void)drained;  // Nothing left to report to: the handle is going away either way.
  engine_.reset();
  for (Binding& binding : bindings_) {
    if (binding.staging) ops_->Free(binding.staging);
  }
  if (empty_tensor_address_) ops_->Free(empty_tensor_address_);
  if (done_event_) ops_->DestroyEvent(done_event_);
  if (own_stream_) ops_->DestroyStream(own_stream_);
  if (home_) {
    for (const Layer& layer : layers_) home_->Release(method_, layer.storage_key);
  }
}

Status Delegate::Drain() {
  if (!in_flight_) return Status::Ok();
  in_flight_ = false;
  return ops_->SynchronizeEvent(done_event_);
}

const void* Delegate::bound_address(const std::string& name) const {
  for (const Binding& binding : bindings_) {
    if (binding.spec.name == name) return binding.bound;
  }
  return nullptr;
}

Status Delegate::EnsureStaging(Binding& binding) {
  if (binding.staging) return Status::Ok();
  if (!binding.max_bytes) {
    return InvalidProgram("binding " + Quote(binding.spec.name) +
                          " has no largest size (a dim is unbounded or the bytes overflow): the "
                          "runtime cannot allocate a buffer for it");
  }
  return ops_->Allocate(*binding.max_bytes, &binding.staging);
}

bool Delegate::StagesFromPageLockedMemory(const Plan& plan) const {
  for (size_t i = 0; i < bindings_.size(); ++i) {
    if (plan.staged[i] && bindings_[i].spec.direction == blob::Direction::kInput &&
        ops_->IsPageLocked(plan.tensors[i]->const_data_ptr())) {
      return true;
    }
  }
  return false;
}

Status Delegate::Validate(Span<EValue*> args, Plan* plan) {
  if (args.size() != signature_.arity()) {
    return InvalidArgument(
        "the delegate takes " + std::to_string(signature_.arity()) + " arguments (" +
        std::to_string(signature_.inputs.size()) + " inputs, " +
        std::to_string(signature_.outputs.size()) + " outputs; aliased outputs " +
        (aliased_outputs_elided_ ? "elided" : "not elided") + ", as the blob records) but got " +
        std::to_string(args.size()) +
        ": the program and the blob disagree on the delegate's signature");
  }
  const bool cuda_engine = engine_->compute_device() == base::ComputeDevice::kCuda;
  plan->tensors.assign(bindings_.size(), nullptr);
  plan->staged.assign(bindings_.size(), false);
  for (size_t i = 0; i < bindings_.size(); ++i) {
    Binding& binding = bindings_[i];
    if (!binding.argument) continue;
    const size_t argument = *binding.argument;
    const bool input = binding.spec.direction == blob::Direction::kInput;
    // Named only when an argument is refused: this runs for every binding at every step.
    const auto what = [&] {
      return std::string(input ? "input " : "output ") + Quote(binding.spec.name) + " (argument " +
             std::to_string(argument) + ")";
    };
    EValue* value = args[argument];
    if (value == nullptr || !value->isTensor()) {
      return InvalidArgument(what() + " is not a tensor");
    }
    Tensor& tensor = value->toTensor();
    if (tensor.scalar_type() != *ToScalarType(binding.spec.dtype)) {
      return InvalidArgument(what() + " has dtype " +
                             executorch::runtime::toString(tensor.scalar_type()) + ", the blob " +
                             blob::ToString(binding.spec.dtype));
    }
    if (static_cast<size_t>(tensor.dim()) != binding.spec.shape.size()) {
      return InvalidArgument(what() + " has rank " + std::to_string(tensor.dim()) + ", the blob " +
                             std::to_string(binding.spec.shape.size()));
    }
    if (input) {
      for (size_t d = 0; d < binding.spec.shape.size(); ++d) {
        const blob::Dim& bounds = binding.spec.shape[d];
        if (tensor.size(d) < bounds.min || tensor.size(d) > bounds.max) {
          return InvalidArgument(what() + " has shape " + ShapeString(ShapeOf(tensor)) + "; dim " +
                                 std::to_string(d) + " must lie in [" +
                                 std::to_string(bounds.min) + ", " + std::to_string(bounds.max) +
                                 "]");
        }
      }
    }
    plan->tensors[i] = &tensor;
    // The runtime binds a buffer of its own there: the caller's memory is never read.
    if (binding.positions_modulo) continue;
    if (input && tensor.nbytes() == 0) continue;
    // Residency is where ExecuTorch planned the buffer; on a CUDA engine the hardware must agree.
    const bool planned_on_device = tensor.device_type() == DeviceType::CUDA;
    const bool wants_device = binding.spec.device == blob::Device::kCuda;
    if (planned_on_device && cuda_engine && tensor.device_index() != device_id_) {
      return InvalidArgument(what() + " is planned on cuda:" + std::to_string(tensor.device_index()) +
                             ", but the delegate runs on cuda:" + std::to_string(device_id_));
    }
    if (planned_on_device && cuda_engine && !wants_device) {
      return InvalidArgument(what() + " is planned in CUDA memory, but the engine reads it on the host "
                                    "(its binding is CPU in the blob)");
    }
    if (planned_on_device && cuda_engine && tensor.nbytes() != 0 &&
        tensor.const_data_ptr() != binding.confirmed_on_device) {
      if (!ops_->IsDeviceMemory(tensor.const_data_ptr())) {
        return InvalidArgument(what() + " is planned in CUDA memory but its pointer is not CUDA "
                               "memory: is a CUDA DeviceAllocator registered?");
      }
      binding.confirmed_on_device = tensor.const_data_ptr();
    }
    if (binding.alias_target && wants_device && !planned_on_device) {
      return InvalidArgument(
          what() + " is host-resident, but it is an aliased input: the engine writes its update "
                 "through this buffer, so it must be device-resident (planned in CUDA memory). "
                 "Staging it would discard the update; was the program finalized without "
                 "non-CPU memory planning?");
    }
    if (wants_device && !planned_on_device && cuda_engine) {
      plan->staged[i] = true;
      if (!input) plan->synchronize = true;
    }
  }
  // A non-elided aliased output that the caller reads on the host needs its copy finished too.
  for (size_t i = 0; i < bindings_.size(); ++i) {
    if (bindings_[i].aliased_input && plan->tensors[i] && cuda_engine &&
        plan->tensors[i]->device_type() != DeviceType::CUDA) {
      plan->synchronize = true;
    }
  }
  if (!layers_.empty()) {
    // The step width is shape metadata of an argument: never a read of its (device) contents.
    const Tensor& source = *plan->tensors[step_binding_];
    plan->step = static_cast<uint64_t>(source.size(static_cast<ssize_t>(step_dim_)));
    for (size_t i = 0; i < bindings_.size(); ++i) {
      const Binding& binding = bindings_[i];
      if (!binding.positions_modulo) continue;
      const auto elements = static_cast<uint64_t>(plan->tensors[i]->numel());
      const bool slots = *binding.positions_modulo != 0;
      if (elements == plan->step || (!slots && elements == 1)) continue;
      return InvalidArgument(
          "input " + Quote(binding.spec.name) + " (argument " + std::to_string(*binding.argument) +
          ") holds " + std::to_string(elements) + (slots ? " slots" : " positions") +
          ", but the runtime fills it with " +
          (slots ? "each token's write slot: it must hold " + std::to_string(plan->step)
                 : "the step's positions: it must hold 1 (the first) or " +
                       std::to_string(plan->step) + " (one per token)") +
          ", the step's width from input " + Quote(bindings_[step_binding_].spec.name));
    }
  }
  for (size_t i = 0; i < bindings_.size(); ++i) {
    if (plan->staged[i]) ZEROKV_RETURN_IF_ERROR(EnsureStaging(bindings_[i]));
  }
  return Status::Ok();
}

Status Delegate::Execute(Span<EValue*> args) {
  Plan plan;
  ZEROKV_RETURN_IF_ERROR(Validate(args, &plan));

  if (!layers_.empty()) {
    // On the thread's sequence, else at home; held for the step from here to the end.
    std::shared_ptr<kvcache::Sequence> sequence = kvcache::CurrentSequence();
    ZEROKV_RETURN_IF_ERROR(UseSequence(sequence ? sequence : home_));
    ZEROKV_RETURN_IF_ERROR(BeginStep(&plan));
  }

  const std::optional<StreamHandle> caller_stream = CurrentCallerStream();
  StreamHandle stream = caller_stream ? *caller_stream : own_stream_;
  // Nothing outside zerokv can order work after our own stream: finish it before returning.
  if (!caller_stream && own_stream_) plan.synchronize = true;
  // Asked at every such step, not once per address: a caller's buffer may be freed and its address
  // reused by memory of the other kind.
  if (!plan.synchronize && StagesFromPageLockedMemory(plan)) plan.synchronize = true;
  Status status = Status::Ok();
  if (in_flight_) {
    // The last execute's work (possibly on another stream) reads and writes the same staging
    // buffers and caches: order this one after it without blocking the host.
    status = ops_->StreamWaitEvent(stream, done_event_);
    if (status.ok()) in_flight_ = false;
  }
  // Whatever happens from here, later users of a cache are ordered after this stream's work on
  // it (a growth copy, a partial run); only a run that finished enqueueing advances a cache.
  for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) {
    if (status.ok()) status = cache->Prepare(stream);
  }
  if (status.ok()) status = Run(plan, stream);
  const bool enqueued = status.ok();
  for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) {
    Status marked = cache->MarkUsed(stream);
    if (status.ok()) status = marked;
  }
  // Only now does the host block: recording the caches' uses above overlaps the run on the device.
  if (enqueued && plan.synchronize) {
    Status finished = ops_->SynchronizeStream(stream);
    // Every use is then over, and the next step's Prepare has nothing to order its stream after.
    for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) {
      if (finished.ok()) finished = cache->LastUseFinished();
    }
    if (status.ok()) status = finished;
  }
  for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) cache->EndStep(status.ok());
  return status;
}

Status Delegate::BeginStep(Plan* plan) {
  for (size_t i = 0; i < caches_.size(); ++i) {
    uint64_t position = 0;
    Status held = caches_[i]->BeginStep(plan->step, &position);
    if (held.ok() && i > 0 && position != plan->position) {
      caches_[i]->EndStep(/*commit=*/false);
      held = InvalidState("KV storage " + Quote(layers_[i].storage_key) + " is at position " +
                          std::to_string(position) + " but " + Quote(layers_[0].storage_key) +
                          " at " + std::to_string(plan->position) +
                          ": the layers of one step must agree (was a cache reset alone?)");
    }
    if (!held.ok()) {
      for (size_t j = 0; j < i; ++j) caches_[j]->EndStep(/*commit=*/false);
      return Status(held.code(), "input " + Quote(bindings_[step_binding_].spec.name) +
                                     " (argument " +
                                     std::to_string(*bindings_[step_binding_].argument) +
                                     ") makes this step write " + std::to_string(plan->step) +
                                     " tokens into KV storage " +
                                     Quote(layers_[i].storage_key) + ": " + held.message());
    }
    plan->position = position;
  }
  return Status::Ok();
}

// The step's positions, as the engine input's dtype, on `stream`: position + i for each element
// (a ring's slots modulo its window); the caller's values are never read.
Status Delegate::FillPositions(size_t index, const Plan& plan, StreamHandle stream) {
  Binding& binding = bindings_[index];
  const auto elements = static_cast<size_t>(plan.tensors[index]->numel());
  const size_t element_size = blob::ElementBytes(binding.spec.dtype);
  binding.fill.resize(elements * element_size);
  const uint64_t modulo = *binding.positions_modulo;
  for (size_t i = 0; i < elements; ++i) {
    uint64_t value = plan.position + i;
    if (modulo != 0) value %= modulo;
    if (binding.spec.dtype == blob::DType::kInt32) {
      if (value > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
        return InvalidArgument("input " + Quote(binding.spec.name) + " is INT32, but the step's "
                               "position " + std::to_string(value) + " does not fit in it");
      }
      const auto narrow = static_cast<int32_t>(value);
      std::memcpy(binding.fill.data() + i * element_size, &narrow, element_size);
    } else {
      const auto wide = static_cast<int64_t>(value);
      std::memcpy(binding.fill.data() + i * element_size, &wide, element_size);
    }
  }
  binding.bound = binding.staging;
  binding.bound_bytes = binding.fill.size();
  if (elements == 0) return Status::Ok();
  return ops_->Copy(binding.staging, binding.fill.data(), binding.fill.size(),
                    CopyKind::kHostToDevice, stream);
}

Status Delegate::Run(Plan& plan, StreamHandle stream) {
  for (size_t i = 0; i < bindings_.size(); ++i) {
    Binding& binding = bindings_[i];
    if (binding.spec.direction != blob::Direction::kInput) continue;
    if (binding.layer) {
      const kvcache::KVCache& cache = *caches_[*binding.layer];
      ZEROKV_RETURN_IF_ERROR(engine_->SetInputShape(binding.spec.name, cache.shape()));
      binding.bound = binding.cache_value ? cache.v() : cache.k();
      binding.bound_bytes = cache.bytes_per_tensor();
      ZEROKV_RETURN_IF_ERROR(
          engine_->SetAddress(binding.spec.name, binding.bound, binding.bound_bytes));
      continue;
    }
    Tensor& tensor = *plan.tensors[i];
    ZEROKV_RETURN_IF_ERROR(engine_->SetInputShape(binding.spec.name, ShapeOf(tensor)));
    if (binding.positions_modulo) {
      ZEROKV_RETURN_IF_ERROR(FillPositions(i, plan, stream));
      ZEROKV_RETURN_IF_ERROR(
          engine_->SetAddress(binding.spec.name, binding.bound, binding.bound_bytes));
      continue;
    }
    if (tensor.nbytes() == 0) {
      binding.bound = empty_tensor_address_;
    } else if (plan.staged[i]) {
      ZEROKV_RETURN_IF_ERROR(ops_->Copy(binding.staging, tensor.const_data_ptr(), tensor.nbytes(),
                                        CopyKind::kHostToDevice, stream));
      binding.bound = binding.staging;
    } else {
      binding.bound = tensor.mutable_data_ptr();
    }
    binding.bound_bytes = tensor.nbytes();
    ZEROKV_RETURN_IF_ERROR(engine_->SetAddress(binding.spec.name, binding.bound, binding.bound_bytes));
  }
  for (size_t i = 0; i < bindings_.size(); ++i) {
    Binding& binding = bindings_[i];
    if (binding.spec.direction != blob::Direction::kOutput) continue;
    size_t capacity = 0;
    if (binding.aliased_input) {
      const Binding& input = bindings_[*binding.aliased_input];
      binding.bound = input.bound;
      capacity = input.bound_bytes;
    } else {
      Tensor& tensor = *plan.tensors[i];
      Status resized = Resize(tensor, MaxShape(binding.spec));
      if (!resized.ok()) {
        return Status(resized.code(), "output " + Quote(binding.spec.name) + " (argument " +
                                          std::to_string(*binding.argument) + ") " +
                                          resized.message());
      }
      capacity = tensor.nbytes();
      binding.bound = capacity == 0      ? empty_tensor_address_
                      : plan.staged[i] ? binding.staging
                                       : tensor.mutable_data_ptr();
    }
    ZEROKV_RETURN_IF_ERROR(engine_->SetAddress(binding.spec.name, binding.bound, capacity));
  }

  ZEROKV_RETURN_IF_ERROR(engine_->Enqueue(stream));
  if (BindingTrace trace = GetBindingTrace()) {
    for (const Binding& binding : bindings_) trace(binding.spec.name.c_str(), binding.bound);
  }

  for (size_t i = 0; i < bindings_.size(); ++i) {
    Binding& binding = bindings_[i];
    if (binding.spec.direction != blob::Direction::kOutput || !plan.tensors[i]) continue;
    Tensor& tensor = *plan.tensors[i];
    std::vector<int64_t> shape;
    ZEROKV_RETURN_IF_ERROR(engine_->OutputShape(binding.spec.name, &shape));
    Status resized = Resize(tensor, shape);
    if (!resized.ok()) {
      return Status(resized.code(), "output " + Quote(binding.spec.name) + " (argument " +
                                        std::to_string(*binding.argument) + ") " +
                                        resized.message());
    }
    if (tensor.nbytes() == 0 || binding.bound == tensor.const_data_ptr()) continue;
    // A staged output, or a non-elided aliased output that ExecuTorch planned apart from its
    // input: the engine's result is at binding.bound and the caller reads the argument.
    const bool to_host = tensor.device_type() != DeviceType::CUDA &&
                         engine_->compute_device() == base::ComputeDevice::kCuda;
    ZEROKV_RETURN_IF_ERROR(ops_->Copy(tensor.mutable_data_ptr(), binding.bound, tensor.nbytes(),
                                      to_host ? CopyKind::kDeviceToHost : CopyKind::kDeviceToDevice,
                                      stream));
  }

  ReleaseRetiredStorage(stream);
  if (PrepareGrowthAhead(plan, stream)) PrepareEngineForGrowth(stream);
  if (plan.synchronize) return Status::Ok();  // Execute finishes the stream
  if (done_event_) {
    ZEROKV_RETURN_IF_ERROR(ops_->RecordEvent(done_event_, stream));
    in_flight_ = true;
  }
  return Status::Ok();
}

// Every layer of a model grows in the same step, and fresh device memory costs the host time to
// allocate (cudaMallocAsync: about 75 us per 64 MiB on an H200): one cache per step reserves its
// next capacity ahead, so that the growth step only copies. Done before the stream is finished or
// its event recorded: the host's time here overlaps the run's device work, and the reserve's
// zeroing is finished or waited on with the run.
bool Delegate::PrepareGrowthAhead(const Plan& plan, StreamHandle stream) {
  // (caches + 1) x width is the least lookahead that leaves every cache a step of its own before
  // the growth step (whose own reservation comes after its growth). Twice that gives each cache a
  // second chance when a reservation fails for want of memory, or when another delegate's wider
  // steps over the same caches close in on the capacity faster, and leaves the step after the last
  // reservation to ready the engine (PrepareEngineForGrowth). It costs only holding the reserves
  // for a few more steps: the peak (every layer's current and next storage) is the same.
  const uint64_t lookahead = 2 * (caches_.size() + 1) * plan.step;
  for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) {
    bool prepared = false;
    // A failed reservation is not this step's failure: the run succeeded and commits. The growth
    // then allocates when it comes, as without a reserve, and reports a lack of memory with the
    // step that needs it. It is still this step's one attempt.
    Status reserved = cache->PrepareGrowth(lookahead, stream, &prepared);
    if (prepared || !reserved.ok()) return false;
  }
  return true;
}

// A growth onto the reserves retires every layer's old storage instead of releasing it, since the
// device's memory pool would give it back to the system at the growth step's end, all layers at
// once (KVCache::ReleaseRetired). One cache per step releases it after the growth. A failed
// release is not this step's failure: its run succeeded.
void Delegate::ReleaseRetiredStorage(StreamHandle stream) {
  for (const std::shared_ptr<kvcache::KVCache>& cache : caches_) {
    bool released = false;
    Status status = cache->ReleaseRetired(stream, &released);
    if (released || !status.ok()) return;
  }
}

// Switching to new storage costs an engine that replays CUDA graphs a capture (the host launches
// every kernel of the step into it), which would make the growth step the slowest of all. Once the
// caches hold their reserves, the engine captures for them here, where the host's time overlaps
// this run's device work; the growth step then only copies rows, updates the engine's executable
// graph from that capture and replays it. Readied once per set of reserves. A failure is not this
// step's: its run succeeded. The engine then does at the growth what it would have without this
// (the AOTInductor engine turns its graphs off on a failed capture, as it would at the growth).
void Delegate::PrepareEngineForGrowth(StreamHandle stream) {
  std::vector<std::optional<kvcache::CacheStorage>> reserves(caches_.size());
  std::vector<std::pair<void*, int64_t>> prepared_for;  // each reserve's K and capacity
  for (size_t layer = 0; layer < caches_.size(); ++layer) {
    kvcache::CacheStorage reserve;
    if (!caches_[layer]->Reserve(&reserve)) continue;
    prepared_for.emplace_back(reserve.k, reserve.shape[2]);
    reserves[layer] = std::move(reserve);
  }
  if (prepared_for.empty() || prepared_for == engine_prepared_for_) return;
  engine_prepared_for_ = std::move(prepared_for);
  for (const Binding& binding : bindings_) {
    const Binding& input = binding.aliased_input ? bindings_[*binding.aliased_input] : binding;
    if (!input.layer || !reserves[*input.layer]) continue;
    const kvcache::CacheStorage& reserve = *reserves[*input.layer];
    if (binding.spec.direction == blob::Direction::kInput &&
        !engine_->SetInputShape(binding.spec.name, reserve.shape).ok()) {
      return;
    }
    void* data = input.cache_value ? reserve.v : reserve.k;
    if (!engine_->SetAddress(binding.spec.name, data, reserve.bytes_per_tensor).ok()) return;
  }
  (void)engine_->Prepare(stream);
}

}  // namespace zerokv::runtime
