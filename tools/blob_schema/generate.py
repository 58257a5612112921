"""Generates the blob codecs from schema.py: a Python module and a C++ header.

    generate.py --python OUT.py   the structural codec of zerokv.blob (format_generated.py)
    generate.py --cpp OUT.h       the structural codec of cc/blob (blob_format.h)

Both emit the same things: the constants, enums and error codes; one record type per struct; a
bounds-checked reader and a writer per struct that take the format version (schema.py says how the
versions' layouts differ); the fixed header. The semantic rules that tie fields together (duplicate
names, aliases, elision, the KV manifest) live in each language's blob module.
"""

import argparse

from tools.blob_schema import schema

# bool is a u8 holding 0 or 1; anything else is refused (BAD_ENUM) by both codecs.
_STRUCT_FORMAT = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i32": "i", "i64": "q", "bool": "B"}
_CPP_TYPE = {
    "u8": "uint8_t",
    "u16": "uint16_t",
    "u32": "uint32_t",
    "u64": "uint64_t",
    "i32": "int32_t",
    "i64": "int64_t",
    "bool": "bool",
}


def _is_enum(field_type):
    return isinstance(field_type, tuple) and field_type[0] == "enum"


def _is_string(field_type):
    return isinstance(field_type, tuple) and field_type[0] == "string"


def _is_list(field_type):
    return isinstance(field_type, tuple) and field_type[0] == "list"


def _fields(struct_name):
    """(name, type, added) of each field of a struct; added is (version, default) or None."""
    fields = []
    for name, field_type, *marks in dict(schema.STRUCTS)[struct_name]:
        fields.append((name, field_type, marks[0][1:] if marks else None))
    return fields


def _check_schema():
    """Added fields end their structs, so that each older layout is a prefix of the newer ones."""
    for struct_name, _ in schema.STRUCTS:
        seen_added = False
        for name, _, added in _fields(struct_name):
            if added is None:
                assert not seen_added, f"{struct_name}.{name} follows an added() field"
                continue
            seen_added = True
            version, default = added
            assert schema.EXTENSIBLE_SINCE <= version <= schema.FORMAT_VERSION, f"{struct_name}.{name}: version {version}"
            assert default in ("", [], 0, False), f"{struct_name}.{name}: default {default!r} is not zero-like"


def _min_size(field_type, extensible):
    """Fewest bytes a value of this type can take: bounds list counts before allocating."""
    if _is_enum(field_type):
        return 1
    if _is_string(field_type) or _is_list(field_type):
        return 4
    if field_type in schema.SCALARS:
        return schema.SCALARS[field_type]
    required = sum(_min_size(t, extensible) for _, t, added in _fields(field_type) if added is None)
    return required + 4 if extensible else required


def _min_size_expr(field_type, cpp):
    """The minimum size as an expression of `version`: a struct's differs between layouts."""
    fixed, extensible = _min_size(field_type, False), _min_size(field_type, True)
    if fixed == extensible:
        return str(fixed)
    if cpp:
        return f"(version >= kExtensibleSince ? {extensible} : {fixed})"
    return f"({extensible} if version >= EXTENSIBLE_SINCE else {fixed})"


def _header_size():
    return sum(4 if t == "magic" else (1 if _is_enum(t) else schema.SCALARS[t]) for _, t in schema.HEADER_FIELDS)


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _camel(name):
    return "".join(part.capitalize() for part in name.lower().split("_"))


# ----------------------------------------------------------------------------------------- Python

_PY_RUNTIME = '''
class BlobFormatError(ValueError):
    """A blob was refused. `code` says which rule, `field` names the field at fault."""

    def __init__(self, code, field, detail):
        super().__init__(f"{code.name} at {field}: {detail}")
        self.code = code
        self.field = field


def check_version(version):
    """`version` if this codec reads it, else BlobFormatError (UNSUPPORTED_VERSION)."""
    if version > FORMAT_VERSION:
        raise BlobFormatError(
            ErrorCode.UNSUPPORTED_VERSION, "header.format_version",
            f"the blob is format version {version}, newer than version {FORMAT_VERSION}, the newest "
            "this zerokv reads: load it with a newer zerokv runtime")
    if version < 1:
        raise BlobFormatError(ErrorCode.UNSUPPORTED_VERSION, "header.format_version",
                              f"{version} is not a format version (they start at 1)")
    return version


class Reader:
    """Reads fields from data[pos:end], refusing any read past `end`."""

    def __init__(self, data, pos=0, end=None):
        self.data = memoryview(data)
        self.pos = pos
        self.end = len(data) if end is None else end

    def remaining(self):
        return self.end - self.pos

    def take(self, size, field):
        if size > self.remaining():
            raise BlobFormatError(
                ErrorCode.TRUNCATED, field, f"needs {size} bytes, {self.remaining()} remain")
        start = self.pos
        self.pos += size
        return self.data[start:self.pos]

    def scalar(self, fmt, field):
        layout = struct.Struct("<" + fmt)
        return layout.unpack(self.take(layout.size, field))[0]

    def boolean(self, field):
        value = self.scalar("B", field)
        if value > 1:
            raise BlobFormatError(ErrorCode.BAD_ENUM, field, f"{value} is not a bool")
        return value == 1

    def enum(self, enum_type, field):
        value = self.scalar("B", field)
        try:
            return enum_type(value)
        except ValueError:
            raise BlobFormatError(
                ErrorCode.BAD_ENUM, field, f"{value} is not a {enum_type.__name__}") from None

    def string(self, field, required):
        length = self.scalar("I", field + ".length")
        raw = bytes(self.take(length, field))
        if required and not raw:
            raise BlobFormatError(ErrorCode.BAD_STRING, field, "a name must not be empty")
        if b"\\0" in raw:
            raise BlobFormatError(ErrorCode.BAD_STRING, field, "holds a NUL byte")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BlobFormatError(ErrorCode.BAD_STRING, field, "is not UTF-8") from None

    def count(self, field, element_min_size):
        count = self.scalar("I", field + ".count")
        if count * element_min_size > self.remaining():
            raise BlobFormatError(
                ErrorCode.COUNT_OVERFLOW, field,
                f"{count} elements of at least {element_min_size} bytes exceed the "
                f"{self.remaining()} bytes that remain")
        return count

    def list(self, field, element_min_size, read_element):
        return [read_element(f"{field}[{i}]") for i in range(self.count(field, element_min_size))]

    def struct(self, field):
        """A reader of the struct here (a u32 size, then its bytes); this reader moves past it."""
        size = self.scalar("I", field + ".size")
        if size > self.remaining():
            raise BlobFormatError(
                ErrorCode.TRUNCATED, field, f"its size {size} exceeds the {self.remaining()} bytes that remain")
        inner = Reader(self.data, self.pos, self.pos + size)
        self.pos += size
        return inner


class Writer:
    def __init__(self):
        self.parts = []

    def scalar(self, fmt, value):
        self.parts.append(struct.pack("<" + fmt, value))

    def string(self, value):
        raw = value.encode("utf-8")
        self.scalar("I", len(raw))
        self.parts.append(raw)

    def struct(self, inner):
        value = inner.getvalue()
        self.scalar("I", len(value))
        self.parts.append(value)

    def getvalue(self):
        return b"".join(self.parts)


def refuse_unwritable(field, version):
    raise BlobFormatError(ErrorCode.UNSUPPORTED_VERSION, field,
                          f"holds a value, but format version {version} has no such field")
'''


def _py_read_expr(field_type, field_expr):
    if _is_enum(field_type):
        return f"reader.enum({field_type[1]}, {field_expr})"
    if _is_string(field_type):
        return f"reader.string({field_expr}, required={field_type[1]})"
    if _is_list(field_type):
        element = field_type[1]
        return (f"reader.list({field_expr}, {_min_size_expr(element, cpp=False)}, "
                f"lambda f: {_py_read_expr(element, 'f')})")
    if field_type == "bool":
        return f"reader.boolean({field_expr})"
    if field_type in schema.SCALARS:
        return f'reader.scalar("{_STRUCT_FORMAT[field_type]}", {field_expr})'
    return f"read_{_snake(field_type)}(reader, {field_expr}, version)"


def _py_write_stmt(field_type, value_expr, field_expr, indent):
    pad = " " * indent
    if _is_enum(field_type):
        return f'{pad}writer.scalar("B", int({value_expr}))\n'
    if _is_string(field_type):
        return f"{pad}writer.string({value_expr})\n"
    if _is_list(field_type):
        index, item = f"i{indent}", f"item{indent}"
        return (
            f'{pad}writer.scalar("I", len({value_expr}))\n'
            f"{pad}for {index}, {item} in enumerate({value_expr}):\n"
            + _py_write_stmt(field_type[1], item, f'{field_expr} + f"[{{{index}}}]"', indent + 4)
        )
    if field_type in schema.SCALARS:
        return f'{pad}writer.scalar("{_STRUCT_FORMAT[field_type]}", int({value_expr}))\n'
    return f"{pad}write_{_snake(field_type)}(writer, {field_expr}, {value_expr}, version)\n"


def _py_annotation(field_type):
    if _is_enum(field_type):
        return field_type[1]
    if _is_string(field_type):
        return "str"
    if _is_list(field_type):
        return f"list[{_py_annotation(field_type[1])}]"
    if field_type in schema.SCALARS:
        return "bool" if field_type == "bool" else "int"
    return field_type


def generate_python():
    _check_schema()
    out = [
        '"""The zerokv blob format. GENERATED from tools/blob_schema/schema.py: do not edit."""',
        "",
        "import dataclasses",
        "import enum",
        "import struct",
        "",
        f"MAGIC = {schema.MAGIC!r}",
        f"FORMAT_VERSION = {schema.FORMAT_VERSION}",
        f"EXTENSIBLE_SINCE = {schema.EXTENSIBLE_SINCE}",
        f"PAYLOAD_ALIGNMENT = {schema.PAYLOAD_ALIGNMENT}",
        f"HEADER_SIZE = {_header_size()}",
        "",
    ]
    for name, members in schema.ENUMS.items():
        out += ["", f"class {name}(enum.IntEnum):"] + [f"    {m} = {v}" for m, v in members] + [""]
    out += ["", "class ErrorCode(enum.IntEnum):"]
    out += [f"    {code} = {i + 1}  # {why}" for i, (code, why) in enumerate(schema.ERROR_CODES)]
    out += ["", _PY_RUNTIME]

    header_fmt = "<" + "".join(
        "4s" if t == "magic" else ("B" if _is_enum(t) else _STRUCT_FORMAT[t]) for _, t in schema.HEADER_FIELDS
    )
    out += ["", "@dataclasses.dataclass", "class Header:"]
    out += [f"    {n}: {'bytes' if t == 'magic' else _py_annotation(t)}" for n, t in schema.HEADER_FIELDS]
    out += [
        "",
        "",
        f"_HEADER = struct.Struct({header_fmt!r})",
        f"_HEADER_BOOLS = {[(i, n) for i, (n, t) in enumerate(schema.HEADER_FIELDS) if t == 'bool']!r}",
        "",
        "",
        "def read_header(data):",
        '    """The fixed header, or BlobFormatError (TRUNCATED_HEADER, BAD_MAGIC, UNSUPPORTED_VERSION, BAD_ENUM)."""',
        "    if len(data) < HEADER_SIZE:",
        "        raise BlobFormatError(ErrorCode.TRUNCATED_HEADER, 'header',",
        "                              f'the blob has {len(data)} bytes, the header needs {HEADER_SIZE}')",
        "    values = list(_HEADER.unpack_from(data, 0))",
        "    if values[0] != MAGIC:",
        "        raise BlobFormatError(ErrorCode.BAD_MAGIC, 'header.magic', f'{values[0]!r} is not {MAGIC!r}')",
        "    check_version(values[1])",
    ]
    for i, (name, field_type) in enumerate(schema.HEADER_FIELDS):
        if _is_enum(field_type):
            out += [
                "    try:",
                f"        values[{i}] = {field_type[1]}(values[{i}])",
                "    except ValueError:",
                f"        raise BlobFormatError(ErrorCode.BAD_ENUM, 'header.{name}',",
                f"                              f'{{values[{i}]}} is not a {field_type[1]}') from None",
            ]
    out += [
        "    for index, name in _HEADER_BOOLS:",
        "        if values[index] > 1:",
        "            raise BlobFormatError(ErrorCode.BAD_ENUM, 'header.' + name, f'{values[index]} is not a bool')",
        "        values[index] = values[index] == 1",
        "    return Header(*values)",
        "",
        "",
        "def write_header(header):",
        "    return _HEADER.pack(*(v if isinstance(v, bytes) else int(v)",
        "                          for v in dataclasses.astuple(header)))",
        "",
    ]
    for name, _ in schema.STRUCTS:
        fields = _fields(name)
        out += ["", "@dataclasses.dataclass", f"class {name}:"]
        for n, t, added in fields:
            if added is None:
                out.append(f"    {n}: {_py_annotation(t)}")
            elif added[1] == []:
                out.append(f"    {n}: {_py_annotation(t)} = dataclasses.field(default_factory=list)")
            else:
                out.append(f"    {n}: {_py_annotation(t)} = {added[1]!r}")
        out += [
            "",
            "",
            f"def read_{_snake(name)}(reader, field, version):",
            "    if version >= EXTENSIBLE_SINCE:",
            "        reader = reader.struct(field)",
        ]
        for n, t, added in fields:
            read = _py_read_expr(t, "field + " + repr("." + n))
            if added is None:
                out.append(f"    {n} = {read}")
            else:
                # Present when the struct has bytes left for it; older blobs end before it.
                out.append(f"    {n} = {read} if version >= {added[0]} and reader.remaining() else {added[1]!r}")
        out += [f"    return {name}(" + ", ".join(f"{n}={n}" for n, _, _ in fields) + ")"]
        out += [
            "",
            "",
            f"def write_{_snake(name)}(writer, field, value, version):",
            "    outer = writer",
            "    if version >= EXTENSIBLE_SINCE:",
            "        writer = Writer()",
        ]
        for n, t, added in fields:
            stmt = _py_write_stmt(t, f"value.{n}", "field + " + repr("." + n), 4).rstrip("\n")
            if added is None:
                out.append(stmt)
                continue
            out.append(f"    if version >= {added[0]}:")
            out.append("\n".join("    " + line for line in stmt.split("\n")))
            out.append(f"    elif value.{n} != {added[1]!r}:")
            out.append(f"        refuse_unwritable(field + {'.' + n!r}, version)")
        out += ["    if version >= EXTENSIBLE_SINCE:", "        outer.struct(writer)", ""]
    out += [
        "",
        "def decode_metadata(data, version):",
        '    """The Metadata struct of format `version` filling all of `data`, or BlobFormatError."""',
        "    reader = Reader(data)",
        "    metadata = read_metadata(reader, 'metadata', check_version(version))",
        "    if reader.remaining():",
        "        raise BlobFormatError(ErrorCode.TRAILING_BYTES, 'metadata',",
        "                              f'{reader.remaining()} bytes follow its last field')",
        "    return metadata",
        "",
        "",
        "def encode_metadata(metadata, version=FORMAT_VERSION):",
        '    """The bytes of `metadata` in format `version`, or BlobFormatError if that version cannot hold it."""',
        "    writer = Writer()",
        "    write_metadata(writer, 'metadata', metadata, check_version(version))",
        "    return writer.getvalue()",
        "",
    ]
    return "\n".join(out)


# -------------------------------------------------------------------------------------------- C++

_CPP_RUNTIME = r"""
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
"""


def _cpp_type(field_type):
    if _is_enum(field_type):
        return field_type[1]
    if _is_string(field_type):
        return "std::string"
    if _is_list(field_type):
        return f"std::vector<{_cpp_type(field_type[1])}>"
    if field_type in schema.SCALARS:
        return _CPP_TYPE[field_type]
    return field_type


def _cpp_read(field_type, field_expr, target, indent):
    pad = " " * indent
    if _is_enum(field_type):
        return f"{pad}if (!reader.Enum({field_expr}, &{target})) return false;\n"
    if _is_string(field_type):
        required = "true" if field_type[1] else "false"
        return f"{pad}if (!reader.String({field_expr}, {required}, &{target})) return false;\n"
    if _is_list(field_type):
        element = field_type[1]
        var = f"i{indent}"
        return (
            f"{pad}{{\n"
            f"{pad}  const std::string list_field = {field_expr};\n"
            f"{pad}  uint32_t count = 0;\n"
            f"{pad}  if (!reader.Count(list_field, {_min_size_expr(element, cpp=True)}, &count)) return false;\n"
            f"{pad}  {target}.resize(count);\n"
            f"{pad}  for (uint32_t {var} = 0; {var} < count; ++{var}) {{\n"
            + _cpp_read(element, f'list_field + "[" + std::to_string({var}) + "]"', f"{target}[{var}]", indent + 4)
            + f"{pad}  }}\n{pad}}}\n"
        )
    if field_type in schema.SCALARS:
        return f"{pad}if (!reader.Scalar({field_expr}, &{target})) return false;\n"
    return f"{pad}if (!Read{field_type}(reader, {field_expr}, version, &{target})) return false;\n"


def _cpp_write(field_type, value_expr, field_expr, indent):
    pad = " " * indent
    if _is_enum(field_type):
        return f"{pad}writer.Enum({value_expr});\n"
    if _is_string(field_type):
        return f"{pad}writer.String({value_expr});\n"
    if _is_list(field_type):
        index = f"i{indent}"
        return (
            f"{pad}writer.Scalar(static_cast<uint32_t>({value_expr}.size()));\n"
            f"{pad}for (size_t {index} = 0; {index} < {value_expr}.size(); ++{index}) {{\n"
            + _cpp_write(field_type[1], f"{value_expr}[{index}]",
                         f'{field_expr} + "[" + std::to_string({index}) + "]"', indent + 2)
            + f"{pad}}}\n"
        )
    if field_type in schema.SCALARS:
        return f"{pad}writer.Scalar<{_CPP_TYPE[field_type]}>({value_expr});\n"
    return f"{pad}Write{field_type}(writer, {field_expr}, version, {value_expr});\n"


def _cpp_default(added):
    default = added[1]
    if default == "":
        return ".empty()"
    if default == []:
        return ".empty()"
    return f" == {str(default).lower()}"


def generate_cpp():
    _check_schema()
    magic = ", ".join(f"0x{b:02x}" for b in schema.MAGIC)
    out = [
        "// The zerokv blob format. GENERATED from tools/blob_schema/schema.py by generate.py: do not edit.",
        "//",
        "// Structural codec only: bounds-checked readers and writers of the header and the metadata.",
        "// cc/blob/blob.h adds the rules that tie fields together and is what callers use.",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "#include <cstring>",
        "#include <optional>",
        "#include <string>",
        "#include <type_traits>",
        "#include <utility>",
        "#include <vector>",
        "",
        "namespace zerokv::blob {",
        "",
        f"inline constexpr uint8_t kMagic[4] = {{{magic}}};",
        f"inline constexpr uint16_t kFormatVersion = {schema.FORMAT_VERSION};",
        f"inline constexpr uint16_t kExtensibleSince = {schema.EXTENSIBLE_SINCE};",
        f"inline constexpr uint64_t kPayloadAlignment = {schema.PAYLOAD_ALIGNMENT};",
        f"inline constexpr size_t kHeaderSize = {_header_size()};",
        "",
    ]
    for name, members in schema.ENUMS.items():
        out += [f"enum class {name} : uint8_t {{"]
        out += [f"  k{_camel(m)} = {v}," for m, v in members] + ["};", ""]
        out += [f"inline bool IsValid({name} value) {{", "  switch (value) {"]
        out += [f"    case {name}::k{_camel(m)}:" for m, _ in members] + ["      return true;", "  }", "  return false;", "}", ""]
        out += [f"inline const char* ToString({name} value) {{", "  switch (value) {"]
        out += [f'    case {name}::k{_camel(m)}:\n      return "{m}";' for m, _ in members]
        out += ["  }", '  return "<invalid>";', "}", ""]
        out += [f'inline const char* EnumName({name}) {{ return "{name}"; }}', ""]
    out += ["enum class ErrorCode : uint8_t {"]
    out += [f"  k{_camel(code)} = {i + 1},  // {why}" for i, (code, why) in enumerate(schema.ERROR_CODES)]
    out += ["};", "", "inline const char* ErrorCodeName(ErrorCode code) {", "  switch (code) {"]
    out += [f'    case ErrorCode::k{_camel(code)}:\n      return "{code}";' for code, _ in schema.ERROR_CODES]
    out += ["  }", '  return "<invalid>";', "}", ""]
    out.append(_CPP_RUNTIME)

    out += ["struct Header {"]
    for name, field_type in schema.HEADER_FIELDS:
        cpp = "uint8_t" if field_type == "magic" else _cpp_type(field_type)
        out.append(f"  {cpp} {name}{'[4]' if field_type == 'magic' else ''}{{}};")
    out += ["};", ""]
    out += [
        "// The fixed header, or false with the refusal in `error` (kTruncatedHeader, kBadMagic,",
        "// kUnsupportedVersion, kBadEnum).",
        "inline bool ReadHeader(const uint8_t* data, size_t size, Header* header, std::optional<Error>* error) {",
        "  if (size < kHeaderSize) {",
        "    *error = Error{ErrorCode::kTruncatedHeader, std::string(\"TRUNCATED_HEADER at header: the blob has \") +",
        "                                                    std::to_string(size) + \" bytes, the header needs \" +",
        "                                                    std::to_string(kHeaderSize)};",
        "    return false;",
        "  }",
        "  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {",
        "    *error = Error{ErrorCode::kBadMagic, \"BAD_MAGIC at header.magic: the blob is not a zerokv blob\"};",
        "    return false;",
        "  }",
        "  std::memcpy(header->magic, data, sizeof(kMagic));",
        "  Reader reader(data + sizeof(kMagic), kHeaderSize - sizeof(kMagic), error);",
        "  if (!reader.Scalar(\"header.format_version\", &header->format_version)) return false;",
        "  if ((*error = CheckVersion(header->format_version))) return false;",
    ]
    for name, field_type in schema.HEADER_FIELDS[2:]:
        if _is_enum(field_type):
            out.append(f'  if (!reader.Enum("header.{name}", &header->{name})) return false;')
        else:
            out.append(f'  if (!reader.Scalar("header.{name}", &header->{name})) return false;')
    out += ["  return true;", "}", ""]
    out += ["inline void WriteHeader(Writer& writer, const Header& header) {"]
    out += ["  for (uint8_t byte : kMagic) writer.Scalar(byte);"]
    for name, field_type in schema.HEADER_FIELDS[1:]:
        out.append(_cpp_write(field_type, f"header.{name}", f'"header.{name}"', 2).rstrip("\n"))
    out += ["}", ""]

    for name, _ in schema.STRUCTS:
        fields = _fields(name)
        out += [f"struct {name} {{"]
        out += [f"  {_cpp_type(t)} {n}{{}};" for n, t, _ in fields]
        out += [f"  bool operator==(const {name}& other) const {{"]
        out += ["    return " + " && ".join(f"{n} == other.{n}" for n, _, _ in fields) + ";", "  }", "};", ""]
        out += [
            f"inline bool Read{name}(Reader& outer, const std::string& field, uint16_t version, {name}* value) {{",
            "  std::optional<Reader> inner;",
            "  if (version >= kExtensibleSince) inner.emplace(outer.Struct(field));",
            "  Reader& reader = inner ? *inner : outer;",
        ]
        for n, t, added in fields:
            read = _cpp_read(t, f'field + ".{n}"', f"value->{n}", 2).rstrip("\n")
            if added is None:
                out.append(read)
            else:
                # Present when the struct has bytes left for it; older blobs end before it.
                out.append(f"  if (version >= {added[0]} && reader.remaining() > 0) {{")
                out.append("\n".join("  " + line for line in read.split("\n")))
                out.append("  }")
        out += ["  return !reader.failed();", "}", ""]
        out += [
            f"inline void Write{name}(Writer& outer, const std::string& field, uint16_t version, const {name}& value) {{",
            "  Writer inner;",
            "  Writer& writer = version >= kExtensibleSince ? inner : outer;",
        ]
        for n, t, added in fields:
            write = _cpp_write(t, f"value.{n}", f'field + ".{n}"', 2).rstrip("\n")
            if added is None:
                out.append(write)
                continue
            out.append(f"  if (version >= {added[0]}) {{")
            out.append("\n".join("  " + line for line in write.split("\n")))
            out.append(f"  }} else if (!(value.{n}{_cpp_default(added)})) {{")
            out.append(f'    writer.RefuseUnwritable(field + ".{n}", version);')
            out.append("  }")
        out += ["  if (version >= kExtensibleSince) outer.Struct(inner);", "}", ""]
    out += [
        "// The Metadata struct of format `version` filling all of [data, data + size), or false with the",
        "// refusal in `error`.",
        "inline bool DecodeMetadata(const uint8_t* data, size_t size, uint16_t version, Metadata* metadata,",
        "                           std::optional<Error>* error) {",
        "  if ((*error = CheckVersion(version))) return false;",
        "  Reader reader(data, size, error);",
        "  if (!ReadMetadata(reader, \"metadata\", version, metadata)) return false;",
        "  if (reader.remaining() != 0) {",
        "    *error = Refuse(ErrorCode::kTrailingBytes, \"metadata\",",
        "                       std::to_string(reader.remaining()) + \" bytes follow its last field\");",
        "    return false;",
        "  }",
        "  return true;",
        "}",
        "",
        "// The bytes of `metadata` in format `version`, or false with the refusal in `error` when that",
        "// version cannot hold it.",
        "inline bool EncodeMetadata(const Metadata& metadata, uint16_t version, std::vector<uint8_t>* out,",
        "                           std::optional<Error>* error) {",
        "  if ((*error = CheckVersion(version))) return false;",
        "  Writer writer;",
        "  WriteMetadata(writer, \"metadata\", version, metadata);",
        "  if ((*error = writer.error())) return false;",
        "  *out = std::move(writer.bytes());",
        "  return true;",
        "}",
        "",
        "}  // namespace zerokv::blob",
        "",
    ]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--python", help="write the Python codec here")
    parser.add_argument("--cpp", help="write the C++ header here")
    args = parser.parse_args()
    if not args.python and not args.cpp:
        parser.error("nothing to generate: pass --python and/or --cpp")
    if args.python:
        with open(args.python, "w") as f:
            f.write(generate_python())
    if args.cpp:
        with open(args.cpp, "w") as f:
            f.write(generate_cpp())


if __name__ == "__main__":
    main()
