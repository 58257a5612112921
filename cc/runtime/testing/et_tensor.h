// OwnedTensor: an ExecuTorch tensor with its own sizes and data, on a chosen device, for tests that
// call the delegate or the backend directly with EValues.
#pragma once

#include <cstdint>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/exec_aten/exec_aten.h>

namespace zerokv::runtime::testing {

template <typename T>
class OwnedTensor {
 public:
  using DeviceType = executorch::runtime::etensor::DeviceType;

  // Data may be placed by the caller (e.g. in "device" memory); by default the tensor owns it.
  OwnedTensor(executorch::aten::ScalarType type, std::vector<int32_t> sizes, DeviceType device,
              T* external_data = nullptr, int8_t device_index = 0)
      : sizes_(sizes.begin(), sizes.end()) {
    size_t numel = 1;
    for (int32_t size : sizes) numel *= static_cast<size_t>(size);
    owned_.assign(numel, T{});
    dim_order_.resize(sizes.size());
    strides_.resize(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) dim_order_[i] = static_cast<uint8_t>(i);
    int32_t stride = 1;
    for (size_t i = sizes.size(); i-- > 0;) {
      strides_[i] = stride;
      stride *= sizes[i];
    }
    data_ = external_data ? external_data : owned_.data();
    impl_ = std::make_unique<executorch::aten::TensorImpl>(
        type, static_cast<ssize_t>(sizes_.size()), sizes_.data(), data_, dim_order_.data(),
        strides_.data(), executorch::aten::TensorShapeDynamism::DYNAMIC_BOUND, device,
        device_index);
    value_ = executorch::runtime::EValue(executorch::aten::Tensor(impl_.get()));
  }

  T* data() { return data_; }
  executorch::runtime::EValue* value() { return &value_; }
  executorch::aten::Tensor tensor() { return value_.toTensor(); }

 private:
  std::vector<int32_t> sizes_;
  std::vector<uint8_t> dim_order_;
  std::vector<int32_t> strides_;
  std::vector<T> owned_;
  T* data_;
  std::unique_ptr<executorch::aten::TensorImpl> impl_;
  executorch::runtime::EValue value_;
};

}  // namespace zerokv::runtime::testing
