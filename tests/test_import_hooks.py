"""openwam_sdpa._import_hooks: a callback right after a module's first
import, whatever asks the import system about the module before."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import textwrap
import zipfile

import pytest

from openwam_sdpa._import_hooks import after_import


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """The name of a module on sys.path that is not imported yet."""
    name = f"owhook_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_runs_after_the_first_import_once(fresh_module):
    calls = []
    after_import(fresh_module, lambda: calls.append(sys.modules[fresh_module].LOADED))
    assert calls == []
    importlib.import_module(fresh_module)
    assert calls == [True]
    importlib.reload(sys.modules[fresh_module])
    assert calls == [True]


def test_an_installed_check_first_keeps_the_hook(fresh_module):
    """importlib.util.find_spec, as libraries check whether a package is
    installed, asks the finders without importing: the import after it still
    runs the callback."""
    calls = []
    after_import(fresh_module, lambda: calls.append(1))
    assert importlib.util.find_spec(fresh_module) is not None
    assert importlib.util.find_spec(fresh_module) is not None
    assert calls == []
    importlib.import_module(fresh_module)
    assert calls == [1]


def test_an_imported_module_runs_it_now(fresh_module):
    importlib.import_module(fresh_module)
    calls = []
    after_import(fresh_module, lambda: calls.append(1))
    assert calls == [1]


def test_a_missing_module_is_still_missing():
    """The hook answers nothing of its own: a module that is not installed
    is not found, and its import raises as without the hook."""
    before = list(sys.meta_path)
    calls = []
    after_import("owhook_not_installed_anywhere", lambda: calls.append(1))
    try:
        assert importlib.util.find_spec("owhook_not_installed_anywhere") is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("owhook_not_installed_anywhere")
        assert calls == []
    finally:
        sys.meta_path[:] = before


def test_a_loader_shared_with_other_modules(tmp_path, monkeypatch):
    """zipimport gives one loader to every module of an archive: another
    module it runs is not the awaited one, and asking twice wraps it once."""
    archive = tmp_path / "owhook_modules.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("owhook_zip_target.py", "LOADED = True\n")
        z.writestr("owhook_zip_other.py", "LOADED = True\n")
    monkeypatch.syspath_prepend(str(archive))
    importlib.invalidate_caches()
    before = list(sys.meta_path)
    seen = []
    after_import("owhook_zip_target", lambda: seen.append("owhook_zip_target" in sys.modules))
    try:
        for _ in range(3):
            assert importlib.util.find_spec("owhook_zip_target") is not None
        importlib.import_module("owhook_zip_other")
        assert seen == []
        importlib.import_module("owhook_zip_target")
        assert seen == [True]
    finally:
        sys.meta_path[:] = before
        for name in ("owhook_zip_target", "owhook_zip_other"):
            sys.modules.pop(name, None)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (optional integration)")
def test_transformers_checked_for_then_imported_has_the_backend():
    """The integration registers when transformers is imported after
    openwam_sdpa, also where an installed-check came between (a fresh
    process: this one may have imported transformers already)."""
    code = textwrap.dedent("""
        import importlib.util
        import openwam_sdpa
        assert importlib.util.find_spec("transformers") is not None
        from transformers import AttentionInterface
        print("openwam_sdpa" in AttentionInterface._global_mapping)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout
