"""Blobs cross languages: Python reads what C++ wrote, and refuses each fixture as C++ does."""

import os

import pytest

from tests.blob import make_fixtures
from zerokv import blob

FIXTURES = os.environ["BLOB_FIXTURES"]


def _manifest():
    with open(os.path.join(FIXTURES, "MANIFEST")) as f:
        return [tuple(line.split()) for line in f if line.strip()]


@pytest.mark.parametrize("name,expected", _manifest(), ids=[name for name, _ in _manifest()])
def test_fixture_parses_or_is_refused_with_its_code(name, expected):
    with open(os.path.join(FIXTURES, name + ".blob"), "rb") as f:
        data = f.read()
    if expected == "OK":
        assert blob.serialize(blob.parse(data)) == data
        return
    with pytest.raises(blob.BlobFormatError) as error:
        blob.parse(data)
    assert error.value.code.name == expected
    assert error.value.field in str(error.value)


def test_every_error_code_has_a_fixture():
    refused = {expected for _, expected in _manifest()}
    assert {code.name for code in blob.ErrorCode} <= refused


def test_reads_what_cpp_wrote():
    with open(os.environ["CC_WRITTEN_BLOB"], "rb") as f:
        data = f.read()
    assert blob.parse(data) == make_fixtures.caller_kv_blob()
    assert data == blob.serialize(make_fixtures.caller_kv_blob())
