"""engine_fingerprint over CPU AOTInductor blobs (//py/zerokv/aoti:decode_blobs): what it lists, what
it finds different between two engines, and what it refuses."""

import dataclasses
import hashlib
import io
import os
import zipfile

import pytest

from tools.bench import engine_fingerprint
from zerokv import blob

ELIDED = os.environ["DECODE_ELIDED_BLOB"]
NOT_ELIDED = os.environ["DECODE_NOT_ELIDED_BLOB"]


def test_every_file_of_the_package_is_listed_with_its_hash_and_size():
    listed = engine_fingerprint.files(ELIDED)
    with open(ELIDED, "rb") as source, zipfile.ZipFile(io.BytesIO(blob.parse(source.read()).payload)) as package:
        expected = {name: (hashlib.sha256(package.read(name)).hexdigest(), package.getinfo(name).file_size)
                    for name in package.namelist()}
    assert listed == expected
    assert any(name.endswith(".wrapper.cpp") for name in listed), sorted(listed)


def test_an_engine_against_itself_differs_in_nothing_and_against_another_program_in_its_code():
    elided, not_elided = engine_fingerprint.files(ELIDED), engine_fingerprint.files(NOT_ELIDED)
    assert engine_fingerprint.differing(elided, dict(elided)) == []
    differ = engine_fingerprint.differing(elided, not_elided)
    assert any(name.endswith(".wrapper.cpp") for name in differ), differ
    assert all(name in not_elided for name in differ)


def test_the_command_prints_the_list_and_the_differences(capsys):
    assert engine_fingerprint.main([ELIDED]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(engine_fingerprint.files(ELIDED))
    digest, size, name = lines[0].split(" ", 2)
    assert (digest, int(size)) == engine_fingerprint.files(ELIDED)[name]
    assert engine_fingerprint.main([ELIDED, ELIDED]) == 0
    assert capsys.readouterr().out == ""


def test_a_file_that_is_not_a_blob_or_holds_no_package_is_refused_by_name(tmp_path, capsys):
    not_a_blob = tmp_path / "notes.txt"
    not_a_blob.write_bytes(b"not a blob")
    with pytest.raises(engine_fingerprint.EngineFingerprintError, match="notes.txt: not a zerokv delegate blob"):
        engine_fingerprint.files(str(not_a_blob))
    with open(ELIDED, "rb") as source:
        parsed = blob.parse(source.read())
    no_package = tmp_path / "plan.blob"
    no_package.write_bytes(blob.serialize(dataclasses.replace(parsed, payload=b"a TensorRT plan")))
    with pytest.raises(engine_fingerprint.EngineFingerprintError,
                       match="plan.blob: its payload is not an AOTInductor package"):
        engine_fingerprint.files(str(no_package))
    assert engine_fingerprint.main([str(no_package)]) == 1
    assert "plan.blob: its payload is not an AOTInductor package" in capsys.readouterr().err
