"""The linkage check of setup.py (BuildAndCheckLinkage): an extension that
carries its own copy of libstdc++'s stream code crashes formatting its first
error message (seen on the H200 machine with /opt/gcc/bin/g++, 2026-11-30), so
setup.py refuses to ship one. The check's function is taken from setup.py's
source (running setup.py would start a build)."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

import openwam_sdpa

SETUP = Path(__file__).resolve().parent.parent / "setup.py"
STREAM_USER = "#include <sstream>\n#include <string>\n" \
              "std::string format(long v) { std::ostringstream s; s << v; return s.str(); }\n"


@pytest.fixture(scope="module")
def private_stream_symbols():
    tree = ast.parse(SETUP.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_private_stream_symbols")
    namespace = {"shutil": shutil, "subprocess": subprocess}
    exec(compile(ast.Module([fn], type_ignores=[]), str(SETUP), "exec"), namespace)
    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not installed: setup.py skips its check the same way")
    return namespace["_private_stream_symbols"]


def test_installed_extension_uses_the_process_libstdcxx(private_stream_symbols):
    assert private_stream_symbols(openwam_sdpa._C.__file__) == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the two probe libraries")
def test_check_tells_a_private_libstdcxx_from_a_shared_one(private_stream_symbols, tmp_path):
    src = tmp_path / "stream_user.cpp"
    src.write_text(STREAM_USER)
    built = {}
    for name, flags in (("shared", []), ("private", ["-static-libstdc++"])):
        out = tmp_path / f"lib{name}.so"
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True)
        built[name] = private_stream_symbols(str(out))
    assert built["shared"] == []
    assert built["private"] and all(s.startswith("_ZNSo") for s in built["private"])
