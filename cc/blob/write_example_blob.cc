// Writes CallerKvBlob() with the C++ writer to argv[1], for the Python side to read.
#include <cstdio>
#include <fstream>
#include <vector>

#include "cc/blob/example_blob.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.blob\n", argv[0]);
    return 2;
  }
  std::vector<uint8_t> bytes;
  if (auto error = zerokv::blob::Serialize(zerokv::blob::testing::CallerKvBlob(), &bytes)) {
    std::fprintf(stderr, "%s\n", error->message.c_str());
    return 1;
  }
  std::ofstream(argv[1], std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return 0;
}
