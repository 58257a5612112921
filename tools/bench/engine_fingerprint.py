"""The files of an AOTInductor engine in a zerokv delegate blob, each with its sha256, so that two
exports of one source whose engines time differently can be compared file by file (step_ab.sh
keeps each tree's, and counts the lines that differ from the baseline's):

    engine_fingerprint.py BLOB            one line per file of the engine package: sha256, bytes, name
"""

import argparse
import hashlib
import io
import sys
import zipfile

from zerokv import blob
from zerokv.errors import ZeroKVError


class EngineFingerprintError(ZeroKVError, ValueError):
    """The file is not a delegate blob holding an AOTInductor package; the message says which."""


def files(path: str) -> dict[str, tuple[str, int]]:
    """{file of the engine package: (its sha256, its bytes)} of the delegate blob at `path`."""
    with open(path, "rb") as source:
        try:
            payload = blob.parse(source.read()).payload
        except blob.BlobFormatError as error:
            raise EngineFingerprintError(f"{path}: not a zerokv delegate blob: {error}") from error
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as package:
            return {name: (hashlib.sha256(package.read(name)).hexdigest(), package.getinfo(name).file_size)
                    for name in package.namelist()}
    except zipfile.BadZipFile as error:
        raise EngineFingerprintError(f"{path}: its payload is not an AOTInductor package (a zip archive): "
                                     f"{error}") from error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("blob")
    args = parser.parse_args(argv)
    try:
        for name, (digest, size) in sorted(files(args.blob).items()):
            print(f"{digest} {size} {name}")
    except (EngineFingerprintError, OSError) as error:
        print(f"engine_fingerprint: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
