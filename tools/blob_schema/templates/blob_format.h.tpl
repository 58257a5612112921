// The zerokv blob format. GENERATED from tools/blob_schema/schema.py by generate.py: do not edit.
//
// Structural codec only: bounds-checked readers and writers of the header and the metadata.
// cc/blob/blob.h adds the rules that tie fields together and is what callers use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace zerokv::blob {

inline constexpr uint8_t kMagic[4] = {${magic}};
inline constexpr uint16_t kFormatVersion = ${format_version};
inline constexpr uint16_t kExtensibleSince = ${extensible_since};
inline constexpr uint64_t kPayloadAlignment = ${payload_alignment};
inline constexpr size_t kHeaderSize = ${header_size};

${enums}
// The member of an enum that ToString names `name`, or false (and `value` untouched).
template <typename E>
bool FromString(const std::string& name, E* value) {
  for (int raw = 0; raw <= UINT8_MAX; ++raw) {
    const auto member = static_cast<E>(raw);
    if (IsValid(member) && name == ToString(member)) {
      *value = member;
      return true;
    }
  }
  return false;
}

// Bytes per element of a DType; 0 for a value DType does not define.
inline size_t ElementBytes(DType dtype) {
  switch (dtype) {
${element_bytes}
  }
  return 0;
}

enum class ErrorCode : uint8_t {
${error_codes}
};

inline const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
${error_code_names}
  }
  return "<invalid>";
}


// A refusal: which rule (code) and a message naming the field at fault.
struct Error {
  ErrorCode code;
  std::string message;
};

inline Error Refuse(ErrorCode code, const std::string& field, const std::string& detail) {
  return Error{code, std::string(ErrorCodeName(code)) + " at " + field + ": " + detail};
}

// The refusal of a format version this codec does not read, or nullopt.
inline std::optional<Error> CheckVersion(uint16_t version) {
  if (version > kFormatVersion) {
    return Refuse(ErrorCode::kUnsupportedVersion, "header.format_version",
                  "the blob is format version " + std::to_string(version) + ", newer than version " +
                      std::to_string(kFormatVersion) +
                      ", the newest this zerokv reads: load it with a newer zerokv runtime");
  }
  if (version < 1) {
    return Refuse(ErrorCode::kUnsupportedVersion, "header.format_version",
                  std::to_string(version) + " is not a format version (they start at 1)");
  }
  return std::nullopt;
}

// Reads fields from [data, data + size), refusing any read past the end. The first refusal goes to
// *error (shared with the readers of enclosing structs) and every later read fails.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, std::optional<Error>* error)
      : data_(data), size_(size), error_(error) {}

  size_t remaining() const { return size_ - pos_; }
  bool failed() const { return error_->has_value(); }

  bool Fail(ErrorCode code, const std::string& field, const std::string& detail) {
    if (!failed()) *error_ = Refuse(code, field, detail);
    return false;
  }

  // A reader of the struct here (a u32 size, then its bytes); this reader moves past it. On a
  // refusal the returned reader is empty and failed.
  Reader Struct(const std::string& field) {
    uint32_t size = 0;
    if (!Scalar(field + ".size", &size)) return Reader(data_, 0, error_);
    if (size > remaining()) {
      Fail(ErrorCode::kTruncated, field,
           "its size " + std::to_string(size) + " exceeds the " + std::to_string(remaining()) + " bytes that remain");
      return Reader(data_, 0, error_);
    }
    Reader inner(data_ + pos_, size, error_);
    pos_ += size;
    return inner;
  }

  template <typename T>
  bool Scalar(const std::string& field, T* out) {
    if (failed()) return false;
    if (sizeof(T) > remaining()) {
      return Fail(ErrorCode::kTruncated, field,
                  "needs " + std::to_string(sizeof(T)) + " bytes, " + std::to_string(remaining()) + " remain");
    }
    // Little-endian by definition of the format, whatever the host.
    uint64_t value = 0;
    for (size_t i = 0; i < sizeof(T); ++i) value |= uint64_t{data_[pos_ + i]} << (8 * i);
    pos_ += sizeof(T);
    if constexpr (std::is_same_v<T, bool>) {
      if (value > 1) return Fail(ErrorCode::kBadEnum, field, std::to_string(value) + " is not a bool");
      *out = value != 0;
    } else {
      *out = static_cast<T>(static_cast<std::make_unsigned_t<T>>(value));
    }
    return true;
  }

  template <typename E>
  bool Enum(const std::string& field, E* out) {
    uint8_t raw = 0;
    if (!Scalar(field, &raw)) return false;
    if (!IsValid(static_cast<E>(raw))) {
      return Fail(ErrorCode::kBadEnum, field, std::to_string(raw) + " is not a " + EnumName(E{}));
    }
    *out = static_cast<E>(raw);
    return true;
  }

  bool String(const std::string& field, bool required, std::string* out) {
    uint32_t length = 0;
    if (!Scalar(field + ".length", &length)) return false;
    if (length > remaining()) {
      return Fail(ErrorCode::kTruncated, field,
                  "needs " + std::to_string(length) + " bytes, " + std::to_string(remaining()) + " remain");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), length);
    pos_ += length;
    if (required && out->empty()) return Fail(ErrorCode::kBadString, field, "a name must not be empty");
    if (out->find('\0') != std::string::npos) return Fail(ErrorCode::kBadString, field, "holds a NUL byte");
    if (!IsUtf8(*out)) return Fail(ErrorCode::kBadString, field, "is not UTF-8");
    return true;
  }

  bool Count(const std::string& field, size_t element_min_size, uint32_t* count) {
    if (!Scalar(field + ".count", count)) return false;
    if (uint64_t{*count} * element_min_size > remaining()) {
      return Fail(ErrorCode::kCountOverflow, field,
                  std::to_string(*count) + " elements of at least " + std::to_string(element_min_size) +
                      " bytes exceed the " + std::to_string(remaining()) + " bytes that remain");
    }
    return true;
  }

 private:
  static bool IsUtf8(const std::string& s) {
    size_t i = 0;
    while (i < s.size()) {
      const auto c = static_cast<unsigned char>(s[i]);
      size_t extra;
      uint32_t code_point;
      if (c < 0x80) { ++i; continue; }
      if ((c & 0xE0) == 0xC0) { extra = 1; code_point = c & 0x1F; }
      else if ((c & 0xF0) == 0xE0) { extra = 2; code_point = c & 0x0F; }
      else if ((c & 0xF8) == 0xF0) { extra = 3; code_point = c & 0x07; }
      else return false;
      if (i + extra >= s.size()) return false;
      for (size_t k = 1; k <= extra; ++k) {
        const auto next = static_cast<unsigned char>(s[i + k]);
        if ((next & 0xC0) != 0x80) return false;
        code_point = (code_point << 6) | (next & 0x3F);
      }
      static constexpr uint32_t kMinForLength[] = {0, 0x80, 0x800, 0x10000};
      if (code_point < kMinForLength[extra] || code_point > 0x10FFFF ||
          (code_point >= 0xD800 && code_point <= 0xDFFF)) {
        return false;  // overlong, out of range or a surrogate: what Python's decoder refuses too
      }
      i += extra + 1;
    }
    return true;
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  std::optional<Error>* error_;
};

class Writer {
 public:
  template <typename T>
  void Scalar(T value) {
    uint64_t raw = 0;
    if constexpr (std::is_same_v<T, bool>) {
      raw = value ? 1 : 0;
    } else {
      raw = static_cast<uint64_t>(static_cast<std::make_unsigned_t<T>>(value));
    }
    for (size_t i = 0; i < sizeof(T); ++i) bytes_.push_back(static_cast<uint8_t>(raw >> (8 * i)));
  }
  template <typename E>
  void Enum(E value) { Scalar(static_cast<uint8_t>(value)); }
  void String(const std::string& value) {
    Scalar(static_cast<uint32_t>(value.size()));
    bytes_.insert(bytes_.end(), value.begin(), value.end());
  }
  // Appends a struct written by `inner` (its u32 size, then its bytes), and inner's refusal.
  void Struct(Writer& inner) {
    if (inner.error_ && !error_) error_ = inner.error_;
    Scalar(static_cast<uint32_t>(inner.bytes_.size()));
    bytes_.insert(bytes_.end(), inner.bytes_.begin(), inner.bytes_.end());
  }
  // A field that format `version` cannot hold holds a value: nothing this writer wrote is valid.
  void RefuseUnwritable(const std::string& field, uint16_t version) {
    if (!error_) {
      error_ = Refuse(ErrorCode::kUnsupportedVersion, field,
                      "holds a value, but format version " + std::to_string(version) + " has no such field");
    }
  }
  std::vector<uint8_t>& bytes() { return bytes_; }
  const std::optional<Error>& error() const { return error_; }

 private:
  std::vector<uint8_t> bytes_;
  std::optional<Error> error_;
};

struct Header {
${header_fields}
};

// The fixed header, or false with the refusal in `error` (kTruncatedHeader, kBadMagic,
// kUnsupportedVersion, kBadEnum).
inline bool ReadHeader(const uint8_t* data, size_t size, Header* header, std::optional<Error>* error) {
  if (size < kHeaderSize) {
    *error = Error{ErrorCode::kTruncatedHeader, std::string("TRUNCATED_HEADER at header: the blob has ") +
                                                    std::to_string(size) + " bytes, the header needs " +
                                                    std::to_string(kHeaderSize)};
    return false;
  }
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    *error = Error{ErrorCode::kBadMagic, "BAD_MAGIC at header.magic: the blob is not a zerokv blob"};
    return false;
  }
  std::memcpy(header->magic, data, sizeof(kMagic));
  Reader reader(data + sizeof(kMagic), kHeaderSize - sizeof(kMagic), error);
  if (!reader.Scalar("header.format_version", &header->format_version)) return false;
  if ((*error = CheckVersion(header->format_version))) return false;
${header_reads}
  return true;
}

inline void WriteHeader(Writer& writer, const Header& header) {
  for (uint8_t byte : kMagic) writer.Scalar(byte);
${header_writes}
}

${structs}
// The Metadata struct of format `version` filling all of [data, data + size), or false with the
// refusal in `error`.
inline bool DecodeMetadata(const uint8_t* data, size_t size, uint16_t version, Metadata* metadata,
                           std::optional<Error>* error) {
  if ((*error = CheckVersion(version))) return false;
  Reader reader(data, size, error);
  if (!ReadMetadata(reader, "metadata", version, metadata)) return false;
  if (reader.remaining() != 0) {
    *error = Refuse(ErrorCode::kTrailingBytes, "metadata", std::to_string(reader.remaining()) + " bytes follow its last field");
    return false;
  }
  return true;
}

// The bytes of `metadata` in format `version`, or false with the refusal in `error` when that
// version cannot hold it.
inline bool EncodeMetadata(const Metadata& metadata, uint16_t version, std::vector<uint8_t>* out,
                           std::optional<Error>* error) {
  if ((*error = CheckVersion(version))) return false;
  Writer writer;
  WriteMetadata(writer, "metadata", version, metadata);
  if ((*error = writer.error())) return false;
  *out = std::move(writer.bytes());
  return true;
}

}  // namespace zerokv::blob
