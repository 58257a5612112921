// libFuzzer target over the blob parser: any input either is refused or parses into a blob that
// writes and parses back to the same contents. ASan and UBSan catch every out-of-bounds read.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cc/blob/blob.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using zerokv::blob::Blob;
  // A copy of exactly `size` bytes, so that ASan sees any read past the end.
  const std::vector<uint8_t> input(data, data + size);
  Blob blob;
  if (zerokv::blob::Parse(input.data(), input.size(), &blob)) return 0;
  std::vector<uint8_t> written;
  if (zerokv::blob::Serialize(blob, &written)) std::abort();  // a parsed blob must be writable
  Blob reparsed;
  if (zerokv::blob::Parse(written.data(), written.size(), &reparsed)) std::abort();
  if (!(reparsed.metadata == blob.metadata) || reparsed.engine_kind != blob.engine_kind ||
      reparsed.device_id != blob.device_id || reparsed.aliased_outputs_elided != blob.aliased_outputs_elided ||
      reparsed.payload_size != blob.payload_size || reparsed.format_version != blob.format_version) {
    std::abort();
  }
  return 0;
}
