"""Blobs cross languages: Python reads what C++ wrote, and refuses each fixture as C++ does."""

import dataclasses
import os

import pytest

from tests.blob import make_fixtures
from zerokv import blob

FIXTURES = os.environ["BLOB_FIXTURES"]


def _manifest():
    with open(os.path.join(FIXTURES, "MANIFEST")) as f:
        return [tuple(line.split()) for line in f if line.strip()]


def _read(name):
    with open(os.path.join(FIXTURES, name + ".blob"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("name,expected", _manifest(), ids=[name for name, _ in _manifest()])
def test_fixture_parses_or_is_refused_with_its_code(name, expected):
    data = _read(name)
    if expected == "OK":
        assert blob.serialize(blob.parse(data)) == data
        return
    if expected.startswith("OK="):
        assert blob.parse(data) == blob.parse(_read(expected[len("OK="):]))
        return
    with pytest.raises(blob.BlobFormatError) as error:
        blob.parse(data)
    assert error.value.code.name == expected
    assert error.value.field in str(error.value)


def test_every_error_code_has_a_fixture():
    refused = {expected for _, expected in _manifest()}
    assert {code.name for code in blob.ErrorCode} <= refused


def test_every_older_version_has_fixtures():
    names = [name for name, _ in _manifest()]
    for version in range(1, blob.FORMAT_VERSION):
        assert f"v{version}_valid_caller_kv" in names


def test_older_versions_read_as_they_were_written():
    for version in (1, 2):
        parsed = blob.parse(_read(f"v{version}_valid_caller_kv"))
        assert parsed == dataclasses.replace(make_fixtures.caller_kv_blob(), format_version=version)
        # Fields added since read as their defaults.
        assert parsed.metadata.engine_key == "" and parsed.metadata.constants == []
    assert blob.parse(_read("v2_valid_runtime_kv")) == dataclasses.replace(make_fixtures.runtime_kv_blob(),
                                                                          format_version=2)
    # Version 1 had no runtime-supplied positions: its model reads the positions its caller gives.
    runtime_kv = blob.parse(_read("v1_valid_runtime_kv"))
    assert len(runtime_kv.metadata.kv_layers) == 2 and runtime_kv.metadata.positions_binding == ""


def test_a_newer_version_is_refused_naming_both_versions():
    with pytest.raises(blob.BlobFormatError) as error:
        blob.parse(_read("newer_version"))
    assert error.value.code == blob.ErrorCode.UNSUPPORTED_VERSION
    assert f"format version {blob.FORMAT_VERSION + 1}, newer than version {blob.FORMAT_VERSION}" in str(error.value)


def test_reads_what_cpp_wrote():
    with open(os.environ["CC_WRITTEN_BLOB"], "rb") as f:
        data = f.read()
    assert blob.parse(data) == make_fixtures.caller_kv_blob()
    assert data == blob.serialize(make_fixtures.caller_kv_blob())
