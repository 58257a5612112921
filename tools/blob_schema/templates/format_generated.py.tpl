"""The zerokv blob format. GENERATED from tools/blob_schema/schema.py: do not edit."""

import dataclasses
import enum
import struct

MAGIC = ${magic}
FORMAT_VERSION = ${format_version}
EXTENSIBLE_SINCE = ${extensible_since}
PAYLOAD_ALIGNMENT = ${payload_alignment}
HEADER_SIZE = ${header_size}

${enums}

class ErrorCode(enum.IntEnum):
${error_codes}


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
        if b"\0" in raw:
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


@dataclasses.dataclass
class Header:
${header_fields}


_HEADER = struct.Struct(${header_format})
_HEADER_BOOLS = ${header_bools}


def read_header(data):
    """The fixed header, or BlobFormatError (TRUNCATED_HEADER, BAD_MAGIC, UNSUPPORTED_VERSION, BAD_ENUM)."""
    if len(data) < HEADER_SIZE:
        raise BlobFormatError(ErrorCode.TRUNCATED_HEADER, 'header',
                              f'the blob has {len(data)} bytes, the header needs {HEADER_SIZE}')
    values = list(_HEADER.unpack_from(data, 0))
    if values[0] != MAGIC:
        raise BlobFormatError(ErrorCode.BAD_MAGIC, 'header.magic', f'{values[0]!r} is not {MAGIC!r}')
    check_version(values[1])
${header_enum_checks}
    for index, name in _HEADER_BOOLS:
        if values[index] > 1:
            raise BlobFormatError(ErrorCode.BAD_ENUM, 'header.' + name, f'{values[index]} is not a bool')
        values[index] = values[index] == 1
    return Header(*values)


def write_header(header):
    return _HEADER.pack(*(v if isinstance(v, bytes) else int(v)
                          for v in dataclasses.astuple(header)))

${structs}

def decode_metadata(data, version):
    """The Metadata struct of format `version` filling all of `data`, or BlobFormatError."""
    reader = Reader(data)
    metadata = read_metadata(reader, 'metadata', check_version(version))
    if reader.remaining():
        raise BlobFormatError(ErrorCode.TRAILING_BYTES, 'metadata',
                              f'{reader.remaining()} bytes follow its last field')
    return metadata


def encode_metadata(metadata, version=FORMAT_VERSION):
    """The bytes of `metadata` in format `version`, or BlobFormatError if that version cannot hold it."""
    writer = Writer()
    write_metadata(writer, 'metadata', metadata, check_version(version))
    return writer.getvalue()
