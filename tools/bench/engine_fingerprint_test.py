"""engine_fingerprint over CPU AOTInductor blobs (//py/zerokv/aoti:decode_blobs): what it lists, that
two programs' engines list apart, and what it refuses."""

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


def test_two_programs_list_apart_in_their_code_and_one_engine_lists_the_same_each_time(capsys):
    listings = []
    for blob_path in (ELIDED, ELIDED, NOT_ELIDED):
        assert engine_fingerprint.main([blob_path]) == 0
        listings.append(set(capsys.readouterr().out.splitlines()))
    assert listings[0] == listings[1]
    differ = listings[2] - listings[0]  # what step_ab.sh counts
    assert any(line.endswith(".wrapper.cpp") for line in differ), sorted(differ)
    digest, size, name = sorted(listings[0])[0].split(" ", 2)
    assert (digest, int(size)) == engine_fingerprint.files(ELIDED)[name]


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
