"""Which torch openwam_sdpa accepts at import, and the ATen schemas it relies on.

The import check itself (python/openwam_sdpa/_extension.py) is exercised with
a stand-in for the compiled module, so every release can be tried on any torch.
The schema test runs against the torch actually installed: run under each
 release with tools/test_torch_version.sh, it is what "checked for 2.11-2.15"
rests on.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from openwam_sdpa import _extension

RANGE = "2.11-2.15"

# The ATen ops the C++ core calls directly (csrc), as torch 2.13.0, 2.14.1 and
# 2.15.0 declare them. A release that changes one of them needs the C++ re-checked.
ATEN_SCHEMAS = {
    "aten::_scaled_dot_product_cudnn_attention":
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, "
        "bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
        "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)",
    "aten::_scaled_dot_product_cudnn_attention_backward":
        "aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, "
        "Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, "
        "Tensor philox_offset, Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, "
        "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, float? scale=None) "
        "-> (Tensor, Tensor, Tensor)",
    "aten::_fused_sdp_choice":
        "aten::_fused_sdp_choice(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_mask=None, float dropout_p=0., bool is_causal=False, *, "
        "float? scale=None, bool enable_gqa=False) -> int",
    "aten::scaled_dot_product_attention":
        "aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_mask=None, float dropout_p=0., bool is_causal=False, *, "
        "float? scale=None, bool enable_gqa=False) -> Tensor",
    "aten::_scaled_dot_product_attention_math":
        "aten::_scaled_dot_product_attention_math(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_mask=None, float dropout_p=0., bool is_causal=False, "
        "Tensor? dropout_mask=None, *, float? scale=None, bool enable_gqa=False) "
        "-> (Tensor, Tensor)",
}


@pytest.fixture
def built_for(monkeypatch):
    """built_for(built, installed): pretend the extension was built for torch
    `built` and torch `installed` is running."""

    def apply(built, installed):
        fake = types.SimpleNamespace(build_info=lambda: {"torch_version": built})
        monkeypatch.setattr(_extension, "_C", fake)
        monkeypatch.setattr(torch, "__version__", installed)

    return apply


def test_running_torch_is_supported_and_imports_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _extension._check_torch_version()
    assert _extension.SUPPORTED[0] <= _extension._release(torch.__version__) <= _extension.SUPPORTED[1]


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130",
                                     "2.14.0a0+git1234abc", "2.15.0+cu132", "2.15.1"])
def test_supported_releases_import_silently(built_for, version):
    built_for(version.split("+")[0], version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _extension._check_torch_version()


@pytest.mark.parametrize("version", ["2.10.0", "2.7.1+cu126", "1.13.1", "2.1.0"])
def test_older_release_is_refused_naming_the_range(built_for, version):
    built_for(version.split("+")[0], version)
    with pytest.raises(ImportError) as info:
        _extension._check_torch_version()
    msg = str(info.value)
    assert f"does not support torch {version.split('+')[0]}" in msg
    assert f"supports torch {RANGE}" in msg
    assert "cuDNN attention ops" in msg  # says why


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0.dev20270101+cu132", "2.17.1", "3.0.0"])
def test_newer_release_warns_naming_the_range_and_the_guard_table(built_for, version):
    built_for(version.split("+")[0], version)
    with pytest.warns(UserWarning) as record:
        _extension._check_torch_version()
    assert len(record) == 1
    msg = str(record[0].message)
    assert f"torch {version.split('+')[0]} is newer" in msg
    assert f"supports torch {RANGE}" in msg
    assert "names cuDNN up to 9.26 (torch 2.15)" in msg
    assert "no known fix" in msg  # what the op does past the table


def test_mismatch_with_an_unsupported_torch_names_the_range(built_for):
    built_for("2.15.0", "2.16.0+cu132")
    with pytest.raises(ImportError) as info:
        _extension._check_torch_version()
    msg = str(info.value)
    assert "built for torch 2.15.0, but torch 2.16.0 is installed" in msg
    assert f"supports torch {RANGE}" in msg
    assert "pip install --no-build-isolation" in msg


def test_mismatch_within_the_range_only_asks_for_a_rebuild(built_for):
    built_for("2.14.1", "2.15.0+cu132")
    with pytest.raises(ImportError) as info:
        _extension._check_torch_version()
    msg = str(info.value)
    assert "built for torch 2.14.1, but torch 2.15.0 is installed" in msg
    assert "pip install --no-build-isolation" in msg
    assert "supports torch" not in msg


def test_support_message_names_every_tested_build():
    # Every release of the range was built and its CPU suite run at least once.
    for version in ("2.11.0+cu130", "2.12.0+cu130", "2.13.0+cpu", "2.14.1+cu130",
                    "2.15.0+cu132"):
        assert version in _extension._SUPPORT
    assert "not built" not in _extension._SUPPORT


@pytest.mark.parametrize("op", sorted(ATEN_SCHEMAS))
def test_aten_schema_is_the_one_the_core_calls(op):
    schemas = [str(s) for s in torch._C._jit_get_schemas_for_operator(op)]
    assert schemas == [ATEN_SCHEMAS[op]], f"torch {torch.__version__} changed {op}"


def test_newest_known_cudnn_is_the_guard_tables(ow):
    # The warning names the guard table's newest cuDNN (major.minor); the two
    # are written in different languages and must move together.
    newest = ow.build_info()["newest_known_cudnn"]
    assert _extension.NEWEST_KNOWN_CUDNN == f"{newest // 10000}.{newest // 100 % 100}"
