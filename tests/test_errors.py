"""Misuse of openwam::sdpa / openwam::pad_keys gives a clear error, never a
crash or a hang: every message names the op, the argument, and what arrived
(csrc/sdpa_inputs.cpp, csrc/padding.cpp, csrc/settings.cpp)."""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import pytest
import torch

from conftest import make_mask, randn

B, H, L, S, E = 2, 3, 4, 6, 8
F64, F32 = torch.float64, torch.float32


def ow():
    import openwam_sdpa

    return openwam_sdpa


def q_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, L, E)), dtype=dtype, seed=1, **kw)


def k_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=2, **kw)


def v_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=3, **kw)


def sdpa(q=None, k=None, v=None, mask=None, **kw):
    q = q_() if q is None else q
    k = k_() if k is None else k
    v = v_() if v is None else v
    return ow().sdpa(q, k, v, mask, **kw)


def pad(k=None, v=None, mask=None, multiple=128):
    k = k_() if k is None else k
    v = v_() if v is None else v
    return ow().pad_keys(k, v, mask, multiple)


class Misuse(NamedTuple):
    call: Callable[[], object]
    op: str  # "sdpa" or "pad_keys"
    argument: str  # the argument's name, as the message spells it
    got: str  # what arrived, as the message spells it


META = "meta"
CASES = {
    # dtypes
    "key_dtype": Misuse(lambda: sdpa(k=k_(dtype=F32)), "sdpa", "key must have query's dtype (Double)", "got Float"),
    "value_dtype": Misuse(lambda: sdpa(v=v_(dtype=torch.float16)), "sdpa", "value must have query's dtype (Double)", "got Half"),
    "query_integer": Misuse(lambda: sdpa(q_().long(), k_().long(), v_().long()), "sdpa", "query must be a floating point tensor", "got Long"),
    "query_bool": Misuse(lambda: sdpa(q_().bool(), k_().bool(), v_().bool()), "sdpa", "query must be a floating point tensor", "got Bool"),
    # devices (a meta tensor stands in for another device)
    "key_device": Misuse(lambda: sdpa(k=k_().to(META)), "sdpa", "key must be on query's device (cpu)", "got meta"),
    "value_device": Misuse(lambda: sdpa(v=v_().to(META)), "sdpa", "value must be on query's device (cpu)", "got meta"),
    "query_device": Misuse(lambda: sdpa(q=q_().to(META)), "sdpa", "key must be on query's device (meta)", "got cpu"),
    "mask_device": Misuse(lambda: sdpa(mask=torch.ones(L, S, dtype=torch.bool, device=META)), "sdpa", "attn_mask must be on query's device (cpu)", "got meta"),
    # ranks
    "query_1d": Misuse(lambda: sdpa(q_(E), k_(S, E), v_(S, E)), "sdpa", "query must have at least 2 dims [..., L, E]", "got 1-D"),
    "query_0d": Misuse(lambda: sdpa(torch.tensor(1.0, dtype=F64), torch.tensor(1.0, dtype=F64), torch.tensor(1.0, dtype=F64)), "sdpa", "query must have at least 2 dims", "got 0-D"),
    "key_rank": Misuse(lambda: sdpa(k=k_(B * H, S, E)), "sdpa", "key must have query's rank (4-D)", "got 3-D"),
    "value_rank": Misuse(lambda: sdpa(v=v_(1, B, H, S, E)), "sdpa", "value must have query's rank (4-D)", "got 5-D"),
    # sizes
    "key_batch": Misuse(lambda: sdpa(k=k_(3, H, S, E)), "sdpa", "key must have query's size 2 in batch dim 0", "got 3"),
    "value_batch": Misuse(lambda: sdpa(v=v_(1, H, S, E)), "sdpa", "value must have query's size 2 in batch dim 0", "got 1"),
    "key_batch_3d": Misuse(lambda: sdpa(q_(4, L, E), k_(5, S, E), v_(5, S, E)), "sdpa", "key must have query's size 4 in batch dim 0", "got 5"),
    "key_heads": Misuse(lambda: sdpa(q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 2, S, E)), "sdpa", "key must have query's number of heads (4) unless enable_gqa=True", "got 2"),
    "value_heads": Misuse(lambda: sdpa(q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 4, S, E), enable_gqa=True), "sdpa", "value must have key's number of heads (2)", "got 4"),
    "gqa_not_divisible": Misuse(lambda: sdpa(q_(B, 4, L, E), k_(B, 3, S, E), v_(B, 3, S, E), enable_gqa=True), "sdpa", "with enable_gqa=True, query's heads (4) must be a multiple of key's heads", "got 3"),
    "head_dim": Misuse(lambda: sdpa(k=k_(B, H, S, 4)), "sdpa", "key must have the same head_dim as query (8)", "got 4"),
    "value_seq_len": Misuse(lambda: sdpa(v=v_(B, H, S - 1, E)), "sdpa", "value must have the same sequence length as key (6)", "got 5"),
    # masks
    "mask_integer": Misuse(lambda: sdpa(mask=torch.ones(L, S, dtype=torch.long)), "sdpa", "attn_mask must be bool or have query's dtype (Double)", "got Long"),
    "mask_float32_for_float64": Misuse(lambda: sdpa(mask=torch.zeros(L, S, dtype=F32)), "sdpa", "attn_mask must be bool or have query's dtype (Double)", "got Float"),
    "mask_too_many_dims": Misuse(lambda: sdpa(mask=torch.ones(1, B, H, L, S, dtype=torch.bool)), "sdpa", "attn_mask must have at most 4 dims", "got 5-D"),
    "mask_too_many_dims_3d": Misuse(lambda: sdpa(q_(B, L, E), k_(B, S, E), v_(B, S, E), torch.ones(1, B, L, S, dtype=torch.bool)), "sdpa", "attn_mask must have at most 3 dims", "got 4-D"),
    "mask_key_dim": Misuse(lambda: sdpa(mask=torch.ones(B, H, L, S + 1, dtype=torch.bool)), "sdpa", "attn_mask of shape [2, 3, 4, 7] does not broadcast to the attention shape [2, 3, 4, 6] (dim -1: expected 6 or 1", "got 7"),
    "mask_query_dim": Misuse(lambda: sdpa(mask=torch.ones(L + 2, S, dtype=torch.bool)), "sdpa", "attn_mask of shape [6, 6] does not broadcast to the attention shape [2, 3, 4, 6] (dim -2: expected 4 or 1", "got 6"),
    "mask_head_dim": Misuse(lambda: sdpa(mask=torch.ones(B, 2, L, S, dtype=torch.bool)), "sdpa", "attn_mask of shape [2, 2, 4, 6] does not broadcast to the attention shape [2, 3, 4, 6] (dim -3: expected 3 or 1", "got 2"),
    "mask_batch_dim": Misuse(lambda: sdpa(mask=torch.zeros(3, 1, 1, S, dtype=F64)), "sdpa", "attn_mask of shape [3, 1, 1, 6] does not broadcast to the attention shape [2, 3, 4, 6] (dim -4: expected 2 or 1", "got 3"),
    "mask_gqa_uses_query_heads": Misuse(lambda: sdpa(q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 2, S, E), torch.ones(B, 2, L, S, dtype=torch.bool), enable_gqa=True), "sdpa", "attn_mask of shape [2, 2, 4, 6] does not broadcast to the attention shape [2, 4, 4, 6] (dim -3: expected 4 or 1", "got 2"),
    "mask_requires_grad": Misuse(lambda: sdpa(mask=torch.zeros(L, S, dtype=F64, requires_grad=True)), "sdpa", "attn_mask must not require grad", "got a mask with requires_grad=True"),
    "mask_and_causal": Misuse(lambda: sdpa(mask=torch.ones(L, S, dtype=torch.bool), is_causal=True), "sdpa", "attn_mask and is_causal=True cannot be combined", ""),
    # dropout and scale
    "dropout_negative": Misuse(lambda: sdpa(dropout_p=-0.1), "sdpa", "dropout_p must be in [0, 1)", "got -0.1"),
    "dropout_one": Misuse(lambda: sdpa(dropout_p=1.0), "sdpa", "dropout_p must be in [0, 1)", "got 1"),
    "dropout_above_one": Misuse(lambda: sdpa(dropout_p=1.5), "sdpa", "dropout_p must be in [0, 1)", "got 1.5"),
    "dropout_nan": Misuse(lambda: sdpa(dropout_p=float("nan")), "sdpa", "dropout_p must be in [0, 1)", "got nan"),
    "dropout_inf": Misuse(lambda: sdpa(dropout_p=float("inf")), "sdpa", "dropout_p must be in [0, 1)", "got inf"),
    "scale_zero": Misuse(lambda: sdpa(scale=0.0), "sdpa", "scale must be a positive finite number or None", "got 0"),
    "scale_negative": Misuse(lambda: sdpa(scale=-0.5), "sdpa", "scale must be a positive finite number or None", "got -0.5"),
    "scale_inf": Misuse(lambda: sdpa(scale=float("inf")), "sdpa", "scale must be a positive finite number or None", "got inf"),
    "scale_neg_inf": Misuse(lambda: sdpa(scale=float("-inf")), "sdpa", "scale must be a positive finite number or None", "got -inf"),
    "scale_nan": Misuse(lambda: sdpa(scale=float("nan")), "sdpa", "scale must be a positive finite number or None", "got nan"),
    # explain() validates like the op
    "explain_head_dim": Misuse(lambda: ow().explain(q_(), k_(B, H, S, 4), v_()), "sdpa", "key must have the same head_dim as query (8)", "got 4"),
    # pad_keys
    "pad_multiple_zero": Misuse(lambda: pad(multiple=0), "pad_keys", "multiple must be a positive integer", "got 0"),
    "pad_multiple_negative": Misuse(lambda: pad(multiple=-64), "pad_keys", "multiple must be a positive integer", "got -64"),
    "pad_value_length": Misuse(lambda: pad(v=v_(B, H, S + 2, E)), "pad_keys", "value must have the same sequence length as key (6)", "got 8"),
    "pad_mask_integer": Misuse(lambda: pad(mask=torch.ones(L, S, dtype=torch.int32)), "pad_keys", "attn_mask must be bool or floating point", "got Int"),
    "pad_mask_last_dim": Misuse(lambda: pad(mask=torch.ones(L, S - 1, dtype=torch.bool)), "pad_keys", "attn_mask's last dim must be the key length (6) or 1", "got 5"),
    "pad_mask_0d": Misuse(lambda: pad(mask=torch.tensor(True)), "pad_keys", "attn_mask must have at least 1 dim", "got 0-D"),
    "pad_key_1d": Misuse(lambda: pad(k=k_(S), v=v_(S)), "pad_keys", "key must have at least 2 dims [..., S, E]", "got 1-D"),
    "pad_value_1d": Misuse(lambda: pad(v=v_(S)), "pad_keys", "value must have at least 2 dims [..., S, Ev]", "got 1-D"),
}


def expected_pattern(case: Misuse) -> str:
    pattern = re.escape(f"openwam::{case.op}: {case.argument}")
    if case.got:
        pattern += ".*" + re.escape(case.got)
    return pattern


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_misuse_raises_clear_error(case):
    with pytest.raises(RuntimeError, match=expected_pattern(case)) as info:
        case.call()
    # One readable line, not a C++ backtrace.
    assert "Exception raised from" not in str(info.value)


def test_at_least_25_distinct_cases():
    distinct = {expected_pattern(c) for c in CASES.values()}
    assert len(distinct) >= 25


# The env settings are read on every call; invalid values raise.
ENV_CASES = [
    ("OPENWAM_SDPA_CUDNN", "yes", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_CUDNN", "2", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_CUDNN", "true", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_PAD", "sometimes", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_PAD", "ALWAYS", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_PAD", "1", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_CHECK_FINITE", "true", "must be unset, '0' or '1'"),
    ("OPENWAM_SDPA_CHECK_FINITE", "on", "must be unset, '0' or '1'"),
]


@pytest.mark.parametrize("entry", ["sdpa", "explain"])
@pytest.mark.parametrize("name,value,expected", ENV_CASES)
def test_invalid_setting_raises(monkeypatch, entry, name, value, expected):
    monkeypatch.setenv(name, value)
    fn = ow().sdpa if entry == "sdpa" else ow().explain
    pattern = re.escape(
        f"openwam::sdpa: environment variable {name} {expected}, got '{value}'")
    with pytest.raises(RuntimeError, match=pattern):
        fn(q_(), k_(), v_())


@pytest.mark.parametrize("name", ["OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD",
                                  "OPENWAM_SDPA_CHECK_FINITE"])
def test_setting_is_read_per_call(monkeypatch, name):
    q, k, v = q_(), k_(), v_()
    ow().sdpa(q, k, v)
    monkeypatch.setenv(name, "bogus")
    with pytest.raises(RuntimeError, match=name):
        ow().sdpa(q, k, v)
    monkeypatch.delenv(name)
    ow().sdpa(q, k, v)


@pytest.mark.parametrize("name,value", [
    ("OPENWAM_SDPA_CUDNN", ""), ("OPENWAM_SDPA_CUDNN", "0"), ("OPENWAM_SDPA_CUDNN", "1"),
    ("OPENWAM_SDPA_PAD", ""), ("OPENWAM_SDPA_PAD", "auto"), ("OPENWAM_SDPA_PAD", "never"),
    ("OPENWAM_SDPA_PAD", "always"),
    ("OPENWAM_SDPA_CHECK_FINITE", ""), ("OPENWAM_SDPA_CHECK_FINITE", "0"),
    ("OPENWAM_SDPA_CHECK_FINITE", "1"),
])
def test_valid_settings_are_accepted(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    out = ow().sdpa(q_(), k_(), v_())
    assert out.shape == (B, H, L, E)


def test_invalid_setting_does_not_affect_pad_keys(monkeypatch):
    """pad_keys takes no setting: it must keep working."""
    monkeypatch.setenv("OPENWAM_SDPA_PAD", "bogus")
    kp, _, _ = pad()
    assert kp.shape == (B, H, 128, E)


@pytest.mark.parametrize("shape", [(), (S,)], ids=["0-D", "1-D"])
def test_mask_below_2d_raises_clear_error(shape):
    """F.sdpa rejects a 0-D / 1-D mask (with an IndexError from deep inside
    its backend selection); validate_inputs promises a clear error for every
    input F.sdpa rejects, naming the op and the argument."""
    mask = torch.ones(shape, dtype=torch.bool)
    got = f"{len(shape)}-D"
    with pytest.raises(RuntimeError, match=rf"openwam::sdpa: attn_mask.*{got}"):
        sdpa(mask=mask)


def test_mask_that_requires_grad_is_rejected_even_without_grad_mode():
    mask = make_mask("additive", B, H, L, S).requires_grad_()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="openwam::sdpa: attn_mask must not require grad"):
            sdpa(mask=mask)


def test_error_leaves_state_usable():
    """After an error the next valid call works (no leaked backend flags)."""
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
              torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled())
    for case in list(CASES.values())[:10]:
        with pytest.raises(RuntimeError):
            case.call()
    after = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
             torch.backends.cuda.flash_sdp_enabled(),
             torch.backends.cuda.mem_efficient_sdp_enabled())
    assert before == after
    assert sdpa().shape == (B, H, L, E)
