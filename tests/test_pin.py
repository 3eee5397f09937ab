"""vllm-pin.txt and llama-cpp-pin.txt: the one reader every script uses."""

import pytest

from patchseries import REPO_ROOT, SeriesError
from patchseries.pin import load_llama_cpp_pin, load_pin, parse_llama_cpp_pin, parse_pin

GOOD = """\
# comment
version = 0.23.0
commit = 91df0fad4   # trailing comment
sdist = vllm-0.23.0.tar.gz
sdist_sha256 = {sha}
wheel = vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl
wheel_sha256 = {sha}
torch = 2.11.0
"""
SHA = "ab" * 32


def test_parses_every_key():
    pin = parse_pin(GOOD.format(sha=SHA))
    assert pin.version == "0.23.0"
    assert pin.commit == "91df0fad4"
    assert pin.wheel == "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert pin.sdist_sha256 == SHA and pin.torch == "2.11.0"


@pytest.mark.parametrize("text, message", [
    (GOOD.format(sha=SHA).replace("torch = 2.11.0\n", ""), "missing torch"),
    (GOOD.format(sha=SHA) + "torch = 2.12.0\n", "'torch' given twice"),
    (GOOD.format(sha=SHA) + "colour = blue\n", "unknown key 'colour'"),
    (GOOD.format(sha=SHA) + "just words\n", "expected 'key = value'"),
    (GOOD.format(sha="XYZ"), "not 64 lowercase hex"),
    (GOOD.format(sha=SHA).replace("sdist = vllm-0.23.0", "sdist = vllm-0.22.0"), "is not version"),
])
def test_rejects_malformed(text, message):
    with pytest.raises(SeriesError, match=message):
        parse_pin(text)


def test_repository_pin_is_the_release_we_patch():
    pin = load_pin()
    assert pin.version == "0.23.0"
    assert pin.torch == "2.11.0"
    assert pin.sdist_sha256 == "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5"
    assert pin.wheel_sha256 == "872aeb7c36a1ea942216af067ce870ffdf960804e829367e1b4eb36d4831c03c"


def test_non_utf8_pin_file_names_file_and_line(tmp_path):
    pin = tmp_path / "vllm-pin.txt"
    text = GOOD.format(sha=SHA).replace("torch = 2.11.0", "torch = 2.11.0 \xa7")
    pin.write_bytes(text.encode("latin-1"))
    with pytest.raises(SeriesError,
                       match=r"vllm-pin.txt:8: not UTF-8 text \(byte 0xa7 at column 16\)"):
        load_pin(pin)


LLAMA_CPP = """\
version = 0.3.36
sdist = llama_cpp_python-0.3.36.tar.gz
sdist_sha256 = {sha}
"""


def test_llama_cpp_pin_parses_every_key():
    pin = parse_llama_cpp_pin(LLAMA_CPP.format(sha=SHA))
    assert (pin.version, pin.sdist, pin.sdist_sha256) == (
        "0.3.36", "llama_cpp_python-0.3.36.tar.gz", SHA)


@pytest.mark.parametrize("text, message", [
    (LLAMA_CPP.format(sha=SHA).replace("version = 0.3.36\n", ""), "missing version"),
    (LLAMA_CPP.format(sha=SHA) + "wheel = x.whl\n", "unknown key 'wheel'"),
    (LLAMA_CPP.format(sha="XYZ"), "sdist_sha256 is not 64 lowercase hex"),
    (LLAMA_CPP.format(sha=SHA).replace("version = 0.3.36", "version = 0.3.37"),
     "is not llama_cpp_python-0.3.37.tar.gz"),
], ids=["missing-key", "unknown-key", "bad-sha256", "sdist-of-another-version"])
def test_llama_cpp_pin_rejects_malformed(text, message):
    with pytest.raises(SeriesError, match=message):
        parse_llama_cpp_pin(text, "llama-cpp-pin.txt")


def test_repository_llama_cpp_pin_is_the_version_the_gpu_tests_install():
    """tests/requirements-gpu.txt installs llama-cpp-python by version (the
    quantizer and the oracle); the converter comes from the pinned sdist:
    one llama.cpp for both."""
    pin = load_llama_cpp_pin()
    requirements = (REPO_ROOT / "tests" / "requirements-gpu.txt").read_text()
    assert f"llama-cpp-python=={pin.version}\n" in requirements
