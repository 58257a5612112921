"""Generates the blob codecs from schema.py: a Python module and a C++ header.

    generate.py --python OUT.py   the structural codec of zerokv.blob (format_generated.py)
    generate.py --cpp OUT.h       the structural codec of cc/blob (blob_format.h)

Both emit the same things: the constants, enums and error codes; one record type per struct; a
bounds-checked reader and a writer per struct that take the format version (schema.py says how the
versions' layouts differ); the fixed header. The semantic rules that tie fields
together (duplicate names, aliases, elision, the KV manifest) live in each language's blob module.
The code of each that the schema does not shape is written out in templates/ (a .tpl per output).
"""

import argparse
import os
import string

from tools.blob_schema import schema

# What does not depend on the schema (the bounds-checked Reader and Writer, the header and metadata
# entry points), one file per language, with ${...} where the schema's definitions go.
_TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")

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
    """Added fields end their structs in the order they were added, so that each older layout is a
    prefix of the newer ones."""
    for struct_name, _ in schema.STRUCTS:
        last = None
        for name, _, added in _fields(struct_name):
            if added is None:
                assert last is None, f"{struct_name}.{name} follows an added() field"
                continue
            version, default = added
            assert 1 < version <= schema.FORMAT_VERSION, f"{struct_name}.{name}: version {version}"
            assert last is None or last <= version, f"{struct_name}.{name} follows a field added later"
            assert default in ("", [], 0, False), f"{struct_name}.{name}: default {default!r} is not zero-like"
            last = version


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


def _render(template, **sections):
    """templates/`template` with each ${section} replaced by its text."""
    with open(os.path.join(_TEMPLATES, template)) as f:
        return string.Template(f.read()).substitute(sections)


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _camel(name):
    return "".join(part.capitalize() for part in name.lower().split("_"))


# ----------------------------------------------------------------------------------------- Python

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
    enums = []
    for name, members in schema.ENUMS.items():
        enums += ["", f"class {name}(enum.IntEnum):"] + [f"    {m} = {v}" for m, v in members] + [""]
    header_format = "<" + "".join(
        "4s" if t == "magic" else ("B" if _is_enum(t) else _STRUCT_FORMAT[t]) for _, t in schema.HEADER_FIELDS
    )
    header_enum_checks = []
    for i, (name, field_type) in enumerate(schema.HEADER_FIELDS):
        if _is_enum(field_type):
            header_enum_checks += [
                "    try:",
                f"        values[{i}] = {field_type[1]}(values[{i}])",
                "    except ValueError:",
                f"        raise BlobFormatError(ErrorCode.BAD_ENUM, 'header.{name}',",
                f"                              f'{{values[{i}]}} is not a {field_type[1]}') from None",
            ]
    structs = []
    for name, _ in schema.STRUCTS:
        fields = _fields(name)
        structs += ["", "@dataclasses.dataclass", f"class {name}:"]
        for n, t, added in fields:
            if added is None:
                structs.append(f"    {n}: {_py_annotation(t)}")
            elif added[1] == []:
                structs.append(f"    {n}: {_py_annotation(t)} = dataclasses.field(default_factory=list)")
            else:
                structs.append(f"    {n}: {_py_annotation(t)} = {added[1]!r}")
        structs += [
            "",
            "",
            f"def read_{_snake(name)}(reader, field, version):",
            "    if version >= EXTENSIBLE_SINCE:",
            "        reader = reader.struct(field)",
        ]
        for n, t, added in fields:
            read = _py_read_expr(t, "field + " + repr("." + n))
            if added is None:
                structs.append(f"    {n} = {read}")
            else:
                # In a fixed layout, present from its version on; in a sized struct, when bytes are left.
                structs.append(f"    {n} = {read} if version >= {added[0]} and (version < EXTENSIBLE_SINCE or "
                               f"reader.remaining()) else {added[1]!r}")
        structs += [f"    return {name}(" + ", ".join(f"{n}={n}" for n, _, _ in fields) + ")"]
        structs += [
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
                structs.append(stmt)
                continue
            structs.append(f"    if version >= {added[0]}:")
            structs.append("\n".join("    " + line for line in stmt.split("\n")))
            structs.append(f"    elif value.{n} != {added[1]!r}:")
            structs.append(f"        refuse_unwritable(field + {'.' + n!r}, version)")
        structs += ["    if version >= EXTENSIBLE_SINCE:", "        outer.struct(writer)", ""]
    return _render(
        "format_generated.py.tpl",
        magic=repr(schema.MAGIC),
        format_version=schema.FORMAT_VERSION,
        extensible_since=schema.EXTENSIBLE_SINCE,
        payload_alignment=schema.PAYLOAD_ALIGNMENT,
        header_size=_header_size(),
        enums="\n".join(enums),
        error_codes="\n".join(f"    {code} = {i + 1}  # {why}" for i, (code, why) in enumerate(schema.ERROR_CODES)),
        header_fields="\n".join(
            f"    {n}: {'bytes' if t == 'magic' else _py_annotation(t)}" for n, t in schema.HEADER_FIELDS
        ),
        header_format=repr(header_format),
        header_bools=repr([(i, n) for i, (n, t) in enumerate(schema.HEADER_FIELDS) if t == "bool"]),
        header_enum_checks="\n".join(header_enum_checks),
        structs="\n".join(structs),
    )


# -------------------------------------------------------------------------------------------- C++

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


def _cpp_is_default(added):
    """A C++ test that a field holds its zero-like default."""
    return ".empty()" if added[1] in ("", []) else f" == {str(added[1]).lower()}"


def generate_cpp():
    _check_schema()
    enums = []
    for name, members in schema.ENUMS.items():
        enums += [f"enum class {name} : uint8_t {{"]
        enums += [f"  k{_camel(m)} = {v}," for m, v in members] + ["};", ""]
        enums += [f"inline bool IsValid({name} value) {{", "  switch (value) {"]
        enums += [f"    case {name}::k{_camel(m)}:" for m, _ in members]
        enums += ["      return true;", "  }", "  return false;", "}", ""]
        enums += [f"inline const char* ToString({name} value) {{", "  switch (value) {"]
        enums += [f'    case {name}::k{_camel(m)}:\n      return "{m}";' for m, _ in members]
        enums += ["  }", '  return "<invalid>";', "}", ""]
        enums += [f'inline const char* EnumName({name}) {{ return "{name}"; }}', ""]
    dtypes = [m for m, _ in schema.ENUMS["DType"]]
    if sorted(schema.DTYPE_BYTES) != sorted(dtypes):
        raise ValueError(f"schema.DTYPE_BYTES must size every DType {dtypes}, not {sorted(schema.DTYPE_BYTES)}")
    header_fields = []
    for name, field_type in schema.HEADER_FIELDS:
        cpp = "uint8_t" if field_type == "magic" else _cpp_type(field_type)
        header_fields.append(f"  {cpp} {name}{'[4]' if field_type == 'magic' else ''}{{}};")
    header_reads = []
    for name, field_type in schema.HEADER_FIELDS[2:]:
        read = "Enum" if _is_enum(field_type) else "Scalar"
        header_reads.append(f'  if (!reader.{read}("header.{name}", &header->{name})) return false;')
    structs = []
    for name, _ in schema.STRUCTS:
        fields = _fields(name)
        structs += [f"struct {name} {{"]
        structs += [f"  {_cpp_type(t)} {n}{{}};" for n, t, _ in fields]
        structs += [f"  bool operator==(const {name}& other) const {{"]
        structs += ["    return " + " && ".join(f"{n} == other.{n}" for n, _, _ in fields) + ";", "  }", "};", ""]
        structs += [
            f"inline bool Read{name}(Reader& outer, const std::string& field, uint16_t version, {name}* value) {{",
            "  std::optional<Reader> inner;",
            "  if (version >= kExtensibleSince) inner.emplace(outer.Struct(field));",
            "  Reader& reader = inner ? *inner : outer;",
        ]
        for n, t, added in fields:
            read = _cpp_read(t, f'field + ".{n}"', f"value->{n}", 2).rstrip("\n")
            if added is None:
                structs.append(read)
                continue
            # In a fixed layout, present from its version on; in a sized struct, when bytes are left.
            structs.append(f"  if (version >= {added[0]} && (version < kExtensibleSince || reader.remaining() > 0)) {{")
            structs.append("\n".join("  " + line for line in read.split("\n")))
            structs.append("  }")
        structs += ["  return !reader.failed();", "}", ""]
        structs += [
            f"inline void Write{name}(Writer& outer, const std::string& field, uint16_t version, const {name}& value) {{",
            "  Writer inner;",
            "  Writer& writer = version >= kExtensibleSince ? inner : outer;",
        ]
        for n, t, added in fields:
            write = _cpp_write(t, f"value.{n}", f'field + ".{n}"', 2).rstrip("\n")
            if added is None:
                structs.append(write)
                continue
            structs.append(f"  if (version >= {added[0]}) {{")
            structs.append("\n".join("  " + line for line in write.split("\n")))
            structs.append(f"  }} else if (!(value.{n}{_cpp_is_default(added)})) {{")
            structs.append(f'    writer.RefuseUnwritable(field + ".{n}", version);')
            structs.append("  }")
        structs += ["  if (version >= kExtensibleSince) outer.Struct(inner);", "}", ""]
    return _render(
        "blob_format.h.tpl",
        magic=", ".join(f"0x{b:02x}" for b in schema.MAGIC),
        format_version=schema.FORMAT_VERSION,
        extensible_since=schema.EXTENSIBLE_SINCE,
        payload_alignment=schema.PAYLOAD_ALIGNMENT,
        header_size=_header_size(),
        enums="\n".join(enums),
        element_bytes="\n".join(
            f"    case DType::k{_camel(m)}:\n      return {schema.DTYPE_BYTES[m]};" for m in dtypes
        ),
        error_codes="\n".join(
            f"  k{_camel(code)} = {i + 1},  // {why}" for i, (code, why) in enumerate(schema.ERROR_CODES)
        ),
        error_code_names="\n".join(
            f'    case ErrorCode::k{_camel(code)}:\n      return "{code}";' for code, _ in schema.ERROR_CODES
        ),
        header_fields="\n".join(header_fields),
        header_reads="\n".join(header_reads),
        header_writes="\n".join(
            _cpp_write(field_type, f"header.{name}", f'"header.{name}"', 2).rstrip("\n")
            for name, field_type in schema.HEADER_FIELDS[1:]
        ),
        structs="\n".join(structs),
    )


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
