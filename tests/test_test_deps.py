"""tools/test_deps.sh, the one list of Python packages that both test
scripts (test.sh, test_torch_version.sh) install: what it reports missing
for a given python."""

import stat
import subprocess

from support import ROOT


def missing_for(tmp_path, fake_python_body):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + fake_python_body)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run = subprocess.run(["bash", "-c", f'source tools/test_deps.sh && test_deps_missing "{fake}"'],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_a_bare_python_lacks_every_package(tmp_path):
    assert missing_for(tmp_path, "exit 1\n") == [
        "pytest", "hypothesis", "numpy", "pybind11", "wheel", "setuptools>=71"]


def test_only_what_fails_to_import_is_listed(tmp_path):
    # `python -c CODE`: numpy fails to import, everything else (the
    # setuptools version check included) succeeds.
    assert missing_for(tmp_path, 'case "$2" in *numpy*) exit 1;; esac\nexit 0\n') == ["numpy"]


def test_an_old_setuptools_is_listed(tmp_path):
    # The version check is the only -c program that calls sys.exit.
    assert missing_for(tmp_path, 'case "$2" in *sys.exit*) exit 1;; esac\nexit 0\n') == [
        "setuptools>=71"]
