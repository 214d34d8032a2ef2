"""The test command's helpers. tools/test_deps.sh: the one list of Python
packages that both test scripts (test.sh, test_torch_version.sh) install, what
it reports missing for a given python, and test_deps_install, which puts them
in a directory of their own (pip --target) so that the test command leaves the
user's environment alone. tools/installed_is_build.py: whether test.sh may test
the installed package as this checkout's build."""

import json
import stat
import subprocess
import sys

from support import ROOT


def fake_python(tmp_path, body):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def missing_for(tmp_path, fake_python_body):
    fake = fake_python(tmp_path, fake_python_body)
    run = subprocess.run(["bash", "-c", f'source tools/test_deps.sh && test_deps_missing "{fake}"'],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_a_bare_python_lacks_every_package(tmp_path):
    assert missing_for(tmp_path, "exit 1\n") == ["pytest", "hypothesis", "numpy", "wheel", "setuptools>=71"]


def test_only_what_fails_to_import_is_listed(tmp_path):
    # `python -c CODE`: numpy fails to import, everything else (the
    # setuptools version check included) succeeds.
    assert missing_for(tmp_path, 'case "$2" in *numpy*) exit 1;; esac\nexit 0\n') == ["numpy"]


def test_an_old_setuptools_is_listed(tmp_path):
    # The version check is the only -c program that calls sys.exit.
    assert missing_for(tmp_path, 'case "$2" in *sys.exit*) exit 1;; esac\nexit 0\n') == [
        "setuptools>=71"]


def install_with(tmp_path, dry_run_body):
    """test_deps_install with a python whose `-m pip` logs its arguments and
    PYTHONPATH, one line a call, and runs `dry_run_body` for a --dry-run call;
    anything else (the report's parser) runs on the real python."""
    log = tmp_path / "pip-calls"
    fake = fake_python(tmp_path, f"""\
if [ "$1" = "-m" ] && [ "$2" = pip ]; then
  echo "PYTHONPATH=$PYTHONPATH $*" >> "{log}"
  case "$*" in *--dry-run*) {dry_run_body};; esac
  exit 0
fi
exec "{sys.executable}" "$@"
""")
    target = tmp_path / "deps"
    script = f'source tools/test_deps.sh && test_deps_install "{fake}" "{target}" pytest "setuptools>=71"'
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return run.returncode, log.read_text().splitlines() if log.exists() else [], target


def test_install_pins_what_the_resolver_found_missing_and_adds_no_dependencies(tmp_path):
    report = json.dumps({"install": [{"metadata": {"name": "pytest", "version": "9.0"}},
                                     {"metadata": {"name": "pluggy", "version": "1.6"}}]})
    write_report = f"""while [ $# -gt 0 ]; do [ "$1" = --report ] && echo '{report}' > "$2"; shift; done"""
    rc, calls, target = install_with(tmp_path, write_report)
    assert rc == 0
    assert len(calls) == 2
    # what the target already holds counts as there: it is first on the path
    assert calls[0].split()[0].removeprefix("PYTHONPATH=").split(":")[0] == str(target)
    assert "--dry-run" in calls[0] and calls[0].endswith("pytest setuptools>=71")
    assert calls[1].endswith(f"--no-deps --upgrade --target {target} pytest==9.0 pluggy==1.6")


def test_nothing_is_installed_when_nothing_is_missing(tmp_path):
    empty = """while [ $# -gt 0 ]; do [ "$1" = --report ] && echo '{"install": []}' > "$2"; shift; done"""
    rc, calls, _ = install_with(tmp_path, empty)
    assert rc == 0 and len(calls) == 1


def test_a_pip_without_dry_run_installs_the_specs_with_their_dependencies(tmp_path):
    rc, calls, target = install_with(tmp_path, 'echo "no such option: --dry-run" >&2; exit 2')
    assert rc == 0 and len(calls) == 2
    assert calls[1].endswith(f"--upgrade --target {target} pytest setuptools>=71")
    assert "--no-deps" not in calls[1]


def test_a_failing_resolver_fails_the_install(tmp_path):
    rc, calls, _ = install_with(tmp_path, 'echo "ERROR: No matching distribution" >&2; exit 1')
    assert rc != 0 and len(calls) == 1


def package(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def installed_is_build(tmp_path, installed_files):
    source = package(tmp_path / "source", {"__init__.py": "x = 1\n", "sub/mod.py": "y = 2\n"})
    built = package(tmp_path / "built", {"_C.abi3.so": "ELF 1"})
    installed = package(tmp_path / "installed", installed_files)
    run = subprocess.run([sys.executable, "tools/installed_is_build.py", str(installed), str(source), str(built)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode in (0, 1), run.stderr
    return run.returncode == 0


SAME = {"__init__.py": "x = 1\n", "sub/mod.py": "y = 2\n", "_C.abi3.so": "ELF 1",
        "__pycache__/__init__.cpython-311.pyc": "bytecode"}


def test_the_same_files_are_the_same_build(tmp_path):
    assert installed_is_build(tmp_path, SAME)


def test_a_changed_module_is_another_build(tmp_path):
    assert not installed_is_build(tmp_path, {**SAME, "sub/mod.py": "y = 3\n"})


def test_a_module_the_checkout_lacks_is_another_build(tmp_path):
    assert not installed_is_build(tmp_path, {**SAME, "old.py": ""})


def test_another_extension_is_another_build(tmp_path):
    assert not installed_is_build(tmp_path, {**SAME, "_C.abi3.so": "ELF 2"})


def test_no_extension_is_another_build(tmp_path):
    assert not installed_is_build(tmp_path, {k: v for k, v in SAME.items() if not k.endswith(".so")})
