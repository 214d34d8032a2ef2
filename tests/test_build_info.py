"""Build facts, the guard table, and the import-time torch version check."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

TILE = 128
REMAINDERS = list(range(1, TILE))


def test_build_info_matches_running_torch(ow):
    info = ow.build_info()
    assert {"torch_version", "with_cuda", "cudnn_compiled", "cudnn_runtime"} <= set(info)
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert isinstance(info["with_cuda"], bool)
    assert info["cudnn_compiled"] >= 0 and info["cudnn_runtime"] >= 0
    if not torch.cuda.is_available():
        assert info["cudnn_runtime"] == 0


def test_build_info_names_the_cudnn_frontend_it_was_built_with(ow):
    """None without the frontend (every CPU build); else the release setup.py pins."""
    frontend = ow.build_info()["cudnn_frontend"]
    if not ow.build_info()["with_cuda"]:
        assert frontend is None
    if frontend is not None:
        setup = (pathlib.Path(__file__).resolve().parents[1] / "setup.py").read_text()
        pin = re.search(r'^CUDNN_FRONTEND_VERSION = "([^"]+)"', setup, re.M)
        assert pin and frontend == pin.group(1), frontend


def test_explain_reports_the_runtime_cudnn(ow):
    q = torch.randn(1, 1, 2, 8)
    assert ow.explain(q, q, q)["cudnn_runtime"] == ow.build_info()["cudnn_runtime"]


def test_guard_rules(ow):
    rules = ow.guard_rules()
    assert len(rules) >= 1
    names = set()
    for rule in rules:
        text_fields = {"name", "versions", "layout", "defect", "action", "source"}
        range_fields = {"first_version", "end_version", "measured_first_version",
                        "measured_end_version"}
        assert set(rule) == text_fields | range_fields
        for field in text_fields:
            assert isinstance(rule[field], str) and rule[field].strip(), (rule, field)
        assert 0 <= rule["first_version"] < rule["end_version"]
        # A measured part lies inside the rule's range (or is empty).
        lo, hi = rule["measured_first_version"], rule["measured_end_version"]
        assert lo >= hi or rule["first_version"] <= lo < hi <= rule["end_version"]
        # Ragged rows cover sdpa_varlen's cuDNN engine, the others F.sdpa's dense calls.
        assert rule["layout"] == ("ragged" if rule["name"].startswith("ragged_") else "dense")
        names.add(rule["name"])
    assert len(names) == len(rules)  # unique names
    # Every rule cites where the defect is documented.
    assert all("#" in r["source"] for r in rules)
    # The key-tail defect, with its upstream references.
    key_tail = [r for r in rules if "key_tail" in r["name"]]
    assert key_tail and all("cudnn-frontend #160" in r["source"] for r in key_tail)


def test_guard_rules_unmeasured_rows_say_so(ow):
    # What the doctor reads: a row with no measured part must not pass for a
    # measurement of this project, and a measured row names its stack.
    for rule in ow.guard_rules():
        if rule["measured_first_version"] >= rule["measured_end_version"]:
            assert "conservative" in rule["source"], rule
            assert "measured by this project on" not in rule["source"], rule
        else:
            assert "measured by this project on an H200" in rule["source"], rule
            assert "conservative" not in rule["source"], rule


# torch 2.15.0's CUDA wheels pin nvidia-cudnn-cu13==9.26.0.51.
TORCH_2_15_CUDNN = 92600


def test_guard_rules_name_torch_2_15s_cudnn(ow):
    assert TORCH_2_15_CUDNN <= ow.build_info()["newest_known_cudnn"]
    # openwam::sdpa's rows (the ragged rows cover sdpa_varlen's cuDNN engine).
    applying = [r for r in ow.guard_rules()
                if r["first_version"] <= TORCH_2_15_CUDNN < r["end_version"]
                and r["layout"] == "dense"]
    assert [r["name"] for r in applying] == ["bhsq1_backward_plan_segfault", "sq1_nan_dk_dv"]
    for rule in applying:
        assert not rule["measured_first_version"] <= TORCH_2_15_CUDNN < rule["measured_end_version"]
        assert "9.26" in rule["versions"] and "torch 2.15" in rule["versions"], rule
        assert "9.26.0.51" in rule["source"] and "conservative" in rule["source"], rule
    # No key-tail row applies there: the defect is fixed upstream in 9.26.
    assert not any(ow.key_tail_defect(TORCH_2_15_CUDNN, 256 + r, 128) for r in REMAINDERS)


def defective_remainders(ow, version, head_dim, is_causal=False, base=256):
    return [r for r in REMAINDERS
            if ow.key_tail_defect(version, base + r, head_dim, is_causal)]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_key_tail_defect_measured_9_19(ow, head_dim):
    """cuDNN 9.19.0, head_dim 64/128: only s_kv % 128 == 64 (measured)."""
    assert defective_remainders(ow, 91900, head_dim) == [64]
    assert ow.key_tail_defect(91900, 64, head_dim) is True
    assert ow.key_tail_defect(91900, 704, head_dim) is True
    assert ow.key_tail_defect(91900, 77, head_dim) is False
    # is_causal never failed on this stack.
    assert defective_remainders(ow, 91900, head_dim, is_causal=True) == []


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_key_tail_defect_9_19_other_head_dims_conservative(ow, head_dim):
    assert defective_remainders(ow, 91900, head_dim) == REMAINDERS


@pytest.mark.parametrize("version", [90100, 90701, 91500, 91800, 91901, 92000, 92501, 92599])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_key_tail_defect_before_9_26_every_remainder(ow, version, head_dim, is_causal):
    assert defective_remainders(ow, version, head_dim, is_causal) == REMAINDERS


@pytest.mark.parametrize("version", [92600, 92601, 92700, 100000])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_key_tail_defect_fixed_from_9_26(ow, version, head_dim):
    assert defective_remainders(ow, version, head_dim) == []
    assert defective_remainders(ow, version, head_dim, is_causal=True) == []


@pytest.mark.parametrize("version", [90701, 91900, 92501, 92600])
@pytest.mark.parametrize("s_kv", [128, 256, 384, 1024, 4096])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_key_tail_defect_never_for_aligned_keys(ow, version, s_kv, head_dim):
    assert ow.key_tail_defect(version, s_kv, head_dim) is False
    assert ow.key_tail_defect(version, s_kv, head_dim, is_causal=True) is False


def test_key_tail_defect_keywords(ow):
    assert ow.key_tail_defect(cudnn_version=91900, s_kv=192, head_dim=128) is True
    assert ow.key_tail_defect(cudnn_version=91900, s_kv=192, head_dim=128, is_causal=True) is False


# --------------------------------------------------------------------------
# The import-time version check
# --------------------------------------------------------------------------


def test_version_check_passes_for_running_torch(ow):
    from openwam_sdpa import _extension

    _extension._check_torch_version()  # what import ran: no error


def test_version_check_ignores_local_suffix(ow, monkeypatch):
    from openwam_sdpa import _extension

    built = ow.build_info()["torch_version"]
    monkeypatch.setattr(torch, "__version__", built + "+cu999")
    _extension._check_torch_version()


@pytest.mark.parametrize("other", ["2.99.0", "1.0.0+cu118", "0.0.1a0"])
def test_version_check_refuses_other_torch(ow, monkeypatch, other):
    from openwam_sdpa import _extension

    built = ow.build_info()["torch_version"]
    monkeypatch.setattr(torch, "__version__", other)
    with pytest.raises(ImportError) as info:
        _extension._check_torch_version()
    msg = str(info.value)
    assert f"built for torch {built}" in msg
    assert f"torch {other.split('+')[0]} is installed" in msg
    assert "pip install --no-build-isolation" in msg  # says how to fix it


def test_package_metadata(ow):
    assert isinstance(ow.__version__, str) and ow.__version__
    for name in ("sdpa", "pad_keys", "explain", "build_info", "guard_rules",
                 "key_tail_defect", "patch", "unpatch", "patched", "is_patched"):
        assert name in ow.__all__ and callable(getattr(ow, name))
    assert hasattr(torch.ops.openwam, "sdpa") and hasattr(torch.ops.openwam, "pad_keys")
