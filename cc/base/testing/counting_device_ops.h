// CountingDeviceOps: DeviceOps for runtime tests that stands in for a CUDA device in host memory.
// Its allocations count as "device memory"; it records every copy, synchronization and event, so
// tests can prove what the runtime copied (nothing, on the zero-copy path) and when it blocked.
// Safe to use from several threads (a cache created through one delegate's ops serves others);
// read the record once they are done.
#pragma once

#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cc/base/device_ops.h"

namespace zerokv::base::testing {

class CountingDeviceOps final : public DeviceOps {
 public:
  struct Copied {
    CopyKind kind;
    size_t bytes;
    StreamHandle stream;
  };
  struct Freed {
    StreamHandle stream;
    int stream_waits;  // the stream waits made before this free
  };

  // Shared with the test, which keeps a pointer after handing ownership to the delegate.
  struct Record {
    std::vector<Copied> copies;
    int synchronizations = 0;  // stream or event: the host blocked
    std::vector<StreamHandle> synchronized_streams;  // SynchronizeStream's arguments, in order
    int stream_waits = 0;
    int events_recorded = 0;
    // What orders the device's work, in the order the runtime asked for it: "record" (an event),
    // "wait" (a stream on an event), "synchronize" (the host on a stream or event) and "free"
    // (FreeAsync).
    std::vector<std::string> ordering;
    int streams_created = 0;
    int streams_destroyed = 0;
    int allocations_live = 0;
    std::vector<Freed> async_frees;  // FreeAsync calls, in order
    int async_allocations = 0;  // AllocateAsync calls that allocated
    int zeroings = 0;           // Zero calls
    int device_memory_queries = 0;  // IsDeviceMemory calls
    int fail_async_allocation_in = 0;  // n > 0: the n-th AllocateAsync from now fails
    // An allocation of more bytes fails, as on a device with this much memory.
    size_t capacity = std::numeric_limits<size_t>::max();
    std::set<const void*> device_memory;  // what IsDeviceMemory accepts besides allocations
    std::set<const void*> page_locked;    // what IsPageLocked accepts
    int page_locked_queries = 0;          // IsPageLocked calls
    std::mutex mutex;                     // held by every operation
  };

  explicit CountingDeviceOps(Record* record) : record_(record) {}

  Status Allocate(size_t bytes, void** data) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    return AllocateLocked(bytes, data);
  }
  void Free(void* data) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    FreeLocked(data);
  }
  Status AllocateAsync(size_t bytes, StreamHandle, void** data) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    if (record_->fail_async_allocation_in > 0 && --record_->fail_async_allocation_in == 0) {
      return Status(executorch::runtime::Error::MemoryAllocationFailed,
                    "counting device: scripted allocation failure of " + std::to_string(bytes) +
                        " bytes");
    }
    ZEROKV_RETURN_IF_ERROR(AllocateLocked(bytes, data));
    ++record_->async_allocations;
    return Status::Ok();
  }
  Status FreeAsync(void* data, StreamHandle stream) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    record_->async_frees.push_back({stream, record_->stream_waits});
    record_->ordering.push_back("free");
    FreeLocked(data);
    return Status::Ok();
  }
  Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind,
              StreamHandle stream) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    record_->copies.push_back({kind, bytes, stream});
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                size_t rows, CopyKind kind, StreamHandle stream) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    record_->copies.push_back({kind, row_bytes * rows, stream});
    for (size_t row = 0; row < rows; ++row) {
      std::memcpy(static_cast<char*>(dst) + row * dst_pitch,
                  static_cast<const char*>(src) + row * src_pitch, row_bytes);
    }
    return Status::Ok();
  }
  Status Zero(void* data, size_t bytes, StreamHandle) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->zeroings;
    std::memset(data, 0, bytes);
    return Status::Ok();
  }
  Status CreateStream(StreamHandle* stream) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->streams_created;
    *stream = &own_stream_;
    return Status::Ok();
  }
  void DestroyStream(StreamHandle) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->streams_destroyed;
  }
  Status CreateEvent(EventHandle* event) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    *event = &event_;
    return Status::Ok();
  }
  void DestroyEvent(EventHandle) override {}
  Status RecordEvent(EventHandle, StreamHandle) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->events_recorded;
    record_->ordering.push_back("record");
    return Status::Ok();
  }
  Status StreamWaitEvent(StreamHandle, EventHandle) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->stream_waits;
    record_->ordering.push_back("wait");
    return Status::Ok();
  }
  Status SynchronizeEvent(EventHandle) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->synchronizations;
    record_->ordering.push_back("synchronize");
    return Status::Ok();
  }
  Status SynchronizeStream(StreamHandle stream) override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->synchronizations;
    record_->synchronized_streams.push_back(stream);
    record_->ordering.push_back("synchronize");
    return Status::Ok();
  }
  bool IsDeviceMemory(const void* data) const override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->device_memory_queries;
    return record_->device_memory.count(data) != 0;
  }
  bool IsPageLocked(const void* data) const override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    ++record_->page_locked_queries;
    return record_->page_locked.count(data) != 0;
  }

 private:
  Status AllocateLocked(size_t bytes, void** data) {
    if (bytes > record_->capacity) {
      return Status(executorch::runtime::Error::MemoryAllocationFailed,
                    "counting device: " + std::to_string(bytes) + " bytes exceed its capacity");
    }
    *data = std::malloc(bytes == 0 ? 1 : bytes);
    record_->device_memory.insert(*data);
    ++record_->allocations_live;
    return Status::Ok();
  }
  void FreeLocked(void* data) {
    record_->device_memory.erase(data);
    --record_->allocations_live;
    std::free(data);
  }

  Record* record_;
  int own_stream_ = 0;  // its address is the delegate's "stream"
  int event_ = 0;
};

}  // namespace zerokv::base::testing
