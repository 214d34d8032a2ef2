"""openwam_sdpa names its build and the settings a traced graph keeps in
torch.compile's cache keys (python/openwam_sdpa/_compile_cache.py says why):
the tags' values, a user's own tag kept, and, end to end on the CPU, a graph
cached by this build hit again while one cached under another build's tag, or
under other settings, is missed."""
import hashlib
import os
import subprocess
import sys
import textwrap

import torch

import openwam_sdpa
from openwam_sdpa import _C, _compile_cache


def test_tag_is_the_extension_files_hash():
    with open(_C.__file__, "rb") as f:
        want = "openwam_sdpa=" + hashlib.sha256(f.read()).hexdigest()[:16]
    assert _compile_cache.build_tag(_C.__file__) == want
    assert torch.compiler.config.cache_key_tag.split(",")[-2] == want


def test_settings_tag_follows_each_traced_setting(monkeypatch):
    default = _compile_cache.settings_tag()
    assert default.startswith("openwam_sdpa_settings=")
    seen = {default}
    for name, value in (("OPENWAM_SDPA_CUDNN", "0"), ("OPENWAM_SDPA_PAD", "always"),
                        ("OPENWAM_SDPA_VARLEN", "flash")):
        monkeypatch.setenv(name, value)
        seen.add(_compile_cache.settings_tag())
        monkeypatch.delenv(name)
    assert len(seen) == 4
    assert _compile_cache.settings_tag() == default
    monkeypatch.setenv("OPENWAM_SDPA_CHECK_FINITE", "1")  # read as kernels run, not traced
    assert _compile_cache.settings_tag() == default


def test_settings_tag_survives_torchs_cudnn_check(monkeypatch):
    """torch.backends.cudnn.version() raises RuntimeError where torch finds its
    cuDNN incompatible: the tag notes it instead of failing the import."""
    def refuse():
        raise RuntimeError("cuDNN version incompatibility")

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", refuse)
    assert _compile_cache.settings_tag().startswith("openwam_sdpa_settings=")


def test_reload_settings_retags(monkeypatch):
    build = _compile_cache.build_tag(_C.__file__)
    monkeypatch.setenv("OPENWAM_SDPA_CUDNN", "0")
    openwam_sdpa.reload_settings()
    tags = torch.compiler.config.cache_key_tag.split(",")
    assert tags[-2:] == [build, _compile_cache.settings_tag()]
    assert sum(t.startswith("openwam_sdpa") for t in tags) == 2


def test_a_tag_assigned_after_import_gets_the_build_tag_back():
    """A user who assigns cache_key_tag after import drops our entries; the
    next reload_settings() adds both back, the build's too (review: it had
    added the settings' alone). The config's own patch() restores the tag
    (pytest's monkeypatch deleted it from torch.compiler.config on undo, and
    every later compile in the process raised AttributeError)."""
    with torch.compiler.config.patch(cache_key_tag="changed-later"):
        openwam_sdpa.reload_settings()
        assert torch.compiler.config.cache_key_tag.split(",") == [
            "changed-later", _compile_cache.build_tag(_C.__file__), _compile_cache.settings_tag()]


def test_a_users_tag_is_kept_and_ours_replaced_not_repeated():
    ours = "openwam_sdpa=0123456789abcdef"
    assert _compile_cache.with_build_tag("", ours) == ours
    assert _compile_cache.with_build_tag("mine", ours) == f"mine,{ours}"
    assert _compile_cache.with_build_tag(f"mine,openwam_sdpa=ffff,theirs", ours) == \
        f"mine,theirs,{ours}"
    assert _compile_cache.with_build_tag(ours, ours) == ours
    settings = "openwam_sdpa_settings=0123"
    assert _compile_cache.with_build_tag(f"mine,{ours},openwam_sdpa_settings=ffff", ours,
                                         settings) == f"mine,{ours},{settings}"


def test_the_environments_tag_survives_import():
    env = dict(os.environ, TORCH_COMPILE_CACHE_KEY_TAG="mine")
    out = subprocess.run([sys.executable, "-c", "import torch, openwam_sdpa; "
                          "print(torch.compiler.config.cache_key_tag)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == ",".join(["mine", _compile_cache.build_tag(_C.__file__),
                            _compile_cache.settings_tag()])


# One process, its own cache directory: compile, reset dynamo, compile again
# (a hit from AOTAutograd's cache); then each script changes what the key holds.
PRELUDE = textwrap.dedent("""
    import os, torch, openwam_sdpa
    from torch._dynamo.utils import counters
    from openwam_sdpa import _compile_cache

    def f(q, k, v, m):
        return openwam_sdpa.sdpa(q, k, v, attn_mask=m)

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    m = torch.rand(1, 1, 8, 8) > 0.3
    def compiled_hits():
        torch._dynamo.reset()
        before = counters["aot_autograd"]["autograd_cache_hit"]
        torch.compile(f, backend="inductor")(q, k, v, m)
        return counters["aot_autograd"]["autograd_cache_hit"] - before
    first, again = compiled_hits(), compiled_hits()
""")
# Under another build's tag: a miss.
SCRIPT = PRELUDE + textwrap.dedent("""
    config = torch.compiler.config
    config.cache_key_tag = _compile_cache.with_build_tag(config.cache_key_tag,
                                                         "openwam_sdpa=another-build")
    other = compiled_hits()
    print(first, again, other, counters["aot_autograd"]["autograd_cache_miss"])
""")
# OPENWAM_SDPA_CUDNN=0 and reload_settings(), as its docstring says: a miss, so
# that no graph traced under the old route runs.
SETTINGS_SCRIPT = PRELUDE + textwrap.dedent("""
    os.environ["OPENWAM_SDPA_CUDNN"] = "0"
    openwam_sdpa.reload_settings()
    print(first, again, compiled_hits())
""")


def test_another_builds_cached_graph_is_not_taken(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    first, again, other, misses = map(int, r.stdout.split()[-4:])
    assert (first, again, other) == (0, 1, 0), r.stdout
    assert misses == 2, r.stdout


def test_graphs_cached_under_other_settings_are_not_taken(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("OPENWAM_SDPA_CUDNN", None)
    r = subprocess.run([sys.executable, "-c", SETTINGS_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert tuple(map(int, r.stdout.split()[-3:])) == (0, 1, 0), r.stdout
