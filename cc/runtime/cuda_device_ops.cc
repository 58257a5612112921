// DeviceOps over the CUDA runtime API. Every call first makes the delegate's device current, so
// that a runner driving several GPUs from one thread cannot send our work to the wrong one.
#include <cuda_runtime_api.h>

#include <string>

#include "cc/runtime/cuda_pointers.h"
#include "cc/runtime/device_ops.h"

namespace zerokv::runtime {
namespace {

using base::Internal;

Status CudaError(cudaError_t error, const char* what) {
  return Internal(std::string(what) + " failed: " + cudaGetErrorName(error) + " (" +
                  cudaGetErrorString(error) + ")");
}

#define ZEROKV_CUDA_RETURN(call, what)                 \
  do {                                                 \
    cudaError_t zerokv_cuda_error_ = (call);           \
    if (zerokv_cuda_error_ != cudaSuccess) {           \
      return CudaError(zerokv_cuda_error_, what);      \
    }                                                  \
  } while (0)

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(int device_id) : device_id_(device_id) {}

  Status Allocate(size_t bytes, void** data) override {
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(cudaMalloc(data, bytes == 0 ? 1 : bytes), "cudaMalloc");
    return Status::Ok();
  }
  void Free(void* data) override {
    if (MakeCurrent().ok()) cudaFree(data);
  }
  Status AllocateAsync(size_t bytes, StreamHandle stream, void** data) override {
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(
        cudaMallocAsync(data, bytes == 0 ? 1 : bytes, static_cast<cudaStream_t>(stream)),
        "cudaMallocAsync");
    return Status::Ok();
  }
  Status FreeAsync(void* data, StreamHandle stream) override {
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(cudaFreeAsync(data, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
    return Status::Ok();
  }
  Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind,
              StreamHandle stream) override {
    if (bytes == 0) return Status::Ok();
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(
        cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync");
    return Status::Ok();
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                size_t rows, CopyKind kind, StreamHandle stream) override {
    if (row_bytes == 0 || rows == 0) return Status::Ok();
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                         ToCuda(kind), static_cast<cudaStream_t>(stream)),
                       "cudaMemcpy2DAsync");
    return Status::Ok();
  }
  Status Zero(void* data, size_t bytes, StreamHandle stream) override {
    if (bytes == 0) return Status::Ok();
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    ZEROKV_CUDA_RETURN(cudaMemsetAsync(data, 0, bytes, static_cast<cudaStream_t>(stream)),
                       "cudaMemsetAsync");
    return Status::Ok();
  }
  Status CreateStream(StreamHandle* stream) override {
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    cudaStream_t created = nullptr;
    // Non-blocking: the delegate's own stream must not serialize with the legacy default stream,
    // or a missing synchronization would be hidden by an implicit one.
    ZEROKV_CUDA_RETURN(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
    *stream = created;
    return Status::Ok();
  }
  void DestroyStream(StreamHandle stream) override {
    if (MakeCurrent().ok()) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
  Status CreateEvent(EventHandle* event) override {
    ZEROKV_RETURN_IF_ERROR(MakeCurrent());
    cudaEvent_t created = nullptr;
    ZEROKV_CUDA_RETURN(cudaEventCreateWithFlags(&created, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
    *event = created;
    return Status::Ok();
  }
  void DestroyEvent(EventHandle event) override {
    if (MakeCurrent().ok()) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  Status RecordEvent(EventHandle event, StreamHandle stream) override {
    ZEROKV_CUDA_RETURN(
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
    return Status::Ok();
  }
  Status StreamWaitEvent(StreamHandle stream, EventHandle event) override {
    ZEROKV_CUDA_RETURN(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                           static_cast<cudaEvent_t>(event), 0),
                       "cudaStreamWaitEvent");
    return Status::Ok();
  }
  Status SynchronizeEvent(EventHandle event) override {
    ZEROKV_CUDA_RETURN(cudaEventSynchronize(static_cast<cudaEvent_t>(event)),
                       "cudaEventSynchronize");
    return Status::Ok();
  }
  Status SynchronizeStream(StreamHandle stream) override {
    ZEROKV_CUDA_RETURN(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                       "cudaStreamSynchronize");
    return Status::Ok();
  }
  bool IsDeviceMemory(const void* data) const override { return IsCudaDeviceMemory(data); }
  bool IsPageLocked(const void* data) const override { return IsPageLockedHostMemory(data); }

 private:
  Status MakeCurrent() const {
    ZEROKV_CUDA_RETURN(cudaSetDevice(device_id_), "cudaSetDevice");
    return Status::Ok();
  }

  int device_id_;
};

}  // namespace

Status MakeDeviceOps(base::ComputeDevice device, int device_id,
                     std::unique_ptr<DeviceOps>* ops) {
  if (device == base::ComputeDevice::kHost) {
    *ops = std::make_unique<HostDeviceOps>();
  } else {
    *ops = std::make_unique<CudaDeviceOps>(device_id);
  }
  return Status::Ok();
}

}  // namespace zerokv::runtime
