"""Entry point of zerokv_py_test: runs pytest over the test files Bazel passes as arguments."""

import os
import sys

import pytest

if __name__ == "__main__":
    args = ["-p", "no:cacheprovider", "-q", "--import-mode=importlib", "-rs"]
    # Bazel's JUnit report, so that test cases show up in the test.xml of the target.
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    sys.exit(pytest.main(args + sys.argv[1:]))
