"""Bad input behaves exactly as in F.scaled_dot_product_attention.

F.sdpa's contract is the contract: what it accepts, openwam_sdpa accepts
(with the same result), and what it rejects, openwam_sdpa rejects with the
same exception type and message. The op hands every call it does not serve
itself to PyTorch's own implementation, so this holds by construction; these
tests keep it so, through each entry point (openwam_sdpa.sdpa, the op
torch.ops.openwam.sdpa, and the patched F.sdpa). pad_keys and the settings
have errors of their own, tested at the end. test_arg_contract.py holds the
scalar arguments' types, and the one call the op refuses where F.sdpa reads
out of bounds.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import pytest
import torch

from support import F_SDPA, make_mask, randn

B, H, L, S, E = 2, 3, 4, 6, 8
F64, F32 = torch.float64, torch.float32


def q_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, L, E)), dtype=dtype, seed=1, **kw)


def k_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=2, **kw)


def v_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=3, **kw)


class Call(NamedTuple):
    """One call of F.sdpa's signature: positional (q, k, v[, mask]) + keywords."""
    args: Callable[[], tuple]
    kwargs: dict = {}


def call(q=None, k=None, v=None, mask=None, **kwargs):
    return Call(lambda: (q_() if q is None else q(), k_() if k is None else k(),
                         v_() if v is None else v(), None if mask is None else mask()),
                kwargs)


META = "meta"
CASES = {
    # dtypes
    "key_dtype": call(k=lambda: k_(dtype=F32)),
    "value_dtype": call(v=lambda: v_(dtype=torch.float16)),
    "integer_inputs": call(lambda: q_().long(), lambda: k_().long(), lambda: v_().long()),
    "bool_inputs": call(lambda: q_().bool(), lambda: k_().bool(), lambda: v_().bool()),
    # devices (a meta tensor stands in for another device)
    "key_device": call(k=lambda: k_().to(META)),
    "value_device": call(v=lambda: v_().to(META)),
    "query_device": call(q=lambda: q_().to(META)),
    # (A meta mask with CPU inputs is left out: F.sdpa returns uninitialised
    # memory for it, where the op raises; test_arg_contract.py.)
    # ranks
    "query_1d": call(lambda: q_(E), lambda: k_(S, E), lambda: v_(S, E)),
    "query_0d": call(lambda: torch.tensor(1.0, dtype=F64), lambda: torch.tensor(1.0, dtype=F64),
                     lambda: torch.tensor(1.0, dtype=F64)),
    "key_rank": call(k=lambda: k_(B * H, S, E)),
    "value_rank": call(v=lambda: v_(1, B, H, S, E)),
    # sizes
    "key_batch": call(k=lambda: k_(3, H, S, E)),
    "value_batch": call(v=lambda: v_(1, H, S, E)),
    "key_batch_3d": call(lambda: q_(4, L, E), lambda: k_(5, S, E), lambda: v_(5, S, E)),
    "key_heads": call(lambda: q_(B, 4, L, E), lambda: k_(B, 2, S, E), lambda: v_(B, 2, S, E)),
    "value_heads_gqa": call(lambda: q_(B, 4, L, E), lambda: k_(B, 2, S, E), lambda: v_(B, 4, S, E),
                            enable_gqa=True),
    "gqa_not_divisible": call(lambda: q_(B, 4, L, E), lambda: k_(B, 3, S, E),
                              lambda: v_(B, 3, S, E), enable_gqa=True),
    "gqa_divisible": call(lambda: q_(B, 4, L, E), lambda: k_(B, 2, S, E), lambda: v_(B, 2, S, E),
                          enable_gqa=True),
    "head_dim": call(k=lambda: k_(B, H, S, 4)),
    "value_head_dim": call(v=lambda: v_(B, H, S, 4)),
    # (value shorter than key: F.sdpa's CPU kernel reads past value's end;
    # the op raises instead, tested in test_arg_contract.py.)
    # masks
    "mask_integer": call(mask=lambda: torch.ones(L, S, dtype=torch.long)),
    "mask_float32_for_float64": call(mask=lambda: torch.zeros(L, S, dtype=F32)),
    "mask_0d": call(mask=lambda: torch.tensor(True)),
    "mask_1d": call(mask=lambda: torch.ones(S, dtype=torch.bool)),
    "mask_5d": call(mask=lambda: torch.ones(1, B, H, L, S, dtype=torch.bool)),
    "mask_4d_for_3d": call(lambda: q_(B, L, E), lambda: k_(B, S, E), lambda: v_(B, S, E),
                           lambda: torch.ones(1, B, L, S, dtype=torch.bool)),
    "mask_key_dim": call(mask=lambda: torch.ones(B, H, L, S + 1, dtype=torch.bool)),
    "mask_query_dim": call(mask=lambda: torch.ones(L + 2, S, dtype=torch.bool)),
    "mask_head_dim": call(mask=lambda: torch.ones(B, 2, L, S, dtype=torch.bool)),
    "mask_batch_dim": call(mask=lambda: torch.zeros(3, 1, 1, S, dtype=F64)),
    "mask_gqa_key_heads": call(lambda: q_(B, 4, L, E), lambda: k_(B, 2, S, E),
                               lambda: v_(B, 2, S, E),
                               lambda: torch.ones(B, 2, L, S, dtype=torch.bool), enable_gqa=True),
    "mask_and_causal": call(mask=lambda: torch.ones(L, S, dtype=torch.bool), is_causal=True),
    "mask_all_false": call(mask=lambda: torch.zeros(L, S, dtype=torch.bool)),
    # dropout and scale
    "dropout_negative": call(dropout_p=-0.1),
    "dropout_one": call(dropout_p=1.0),
    "dropout_above_one": call(dropout_p=1.5),
    "dropout_nan": call(dropout_p=float("nan")),
    "scale_zero": call(scale=0.0),
    "scale_negative": call(scale=-0.5),
    "scale_inf": call(scale=float("inf")),
    "scale_nan": call(scale=float("nan")),
    # argument types
    "query_not_a_tensor": Call(lambda: ([[1.0]], k_(), v_(), None)),
    "mask_not_a_tensor": Call(lambda: (q_(), k_(), v_()), {"attn_mask": [[True]]}),
    "scale_positional": Call(lambda: (q_(), k_(), v_(), None, 0.0, False, 0.5)),
    "eight_positional": Call(lambda: (q_(), k_(), v_(), None, 0.0, False, 0.5, False)),
    "unknown_keyword": call(window=3),
    "unknown_keyword_and_missing_value": Call(lambda: (q_(), k_()), {"window": 3}),
    "mask_float_keyword": Call(lambda: (q_(), k_(), v_()), {"attn_mask": 1.0}),
    "missing_value": Call(lambda: (q_(), k_())),
    "missing_value_keywords": Call(lambda: (), {"query": q_(), "key": k_()}),
    "missing_key_keywords": Call(lambda: (), {"query": q_(), "value": v_()}),
    "missing_all": Call(lambda: ()),
    "value_none": Call(lambda: (q_(), k_(), None)),
}


def outcome(fn, case: Call, seed=5):
    """('ok', output) or (exception type, message) of one call."""
    args = case.args()
    torch.manual_seed(seed)  # dropout
    try:
        return ("ok", fn(*args, **case.kwargs))
    except Exception as e:  # noqa: BLE001 - the point is to compare any exception
        return (type(e), str(e))


def same_outcome(got, expected, what):
    kind, value = expected
    assert got[0] == kind, f"{what}: {got[0]} ({got[1]!r:.200}) where F.sdpa gives {kind} ({value!r:.200})"
    if kind == "ok":
        torch.testing.assert_close(got[1], value, atol=0, rtol=0, equal_nan=True)
    else:
        assert got[1] == value, f"{what}: message {got[1]!r} where F.sdpa says {value!r}"


def op_call(*args, **kwargs):
    return torch.ops.openwam.sdpa(*args, **kwargs)


def patched_call(ow):
    def call(*args, **kwargs):
        with ow.patch():
            return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    return call


# entry point -> its function, given the package
ENTRY_POINTS = {"openwam_sdpa.sdpa": lambda ow: ow.sdpa, "patched F.sdpa": patched_call}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_same_outcome_as_f_sdpa(ow, case, entry):
    same_outcome(outcome(ENTRY_POINTS[entry](ow), case), outcome(F_SDPA, case), entry)


# Where the entry points' message differs from F.sdpa's, and how (docs/design.md,
# "Drop-in"): exactly these, and nothing else in the message.
DIFFERENT_WORDING = {
    # F.sdpa's message adds " (position N)" for an argument passed by position;
    # the entry points word it as for the common call (attn_mask by keyword).
    "mask_float_positional": (Call(lambda: (q_(), k_(), v_(), 1.0)), ENTRY_POINTS,
                              lambda m: m.replace(" (position 4)", "")),
    # ... and query, key and value by position.
    "key_keyword_not_a_tensor": (Call(lambda: (q_(),), {"key": [[1.0]], "value": v_()}),
                                 ENTRY_POINTS, lambda m: m.replace(
                                     "argument 'key' must", "argument 'key' (position 2) must")),
    # An argument given twice: Python's own binding raises before the call
    # reaches F.sdpa, and names the function it binds.
    "query_twice": (Call(lambda: (q_(), k_(), v_()), {"query": q_()}), ["openwam_sdpa.sdpa"],
                    lambda m: m.replace("scaled_dot_product_attention()", "sdpa()")),
}


@pytest.mark.parametrize("case", DIFFERENT_WORDING)
def test_where_the_wording_differs(ow, case):
    call, entries, expected_of = DIFFERENT_WORDING[case]
    kind, stock = outcome(F_SDPA, call)
    assert kind is TypeError
    for entry in ENTRY_POINTS:
        got = outcome(ENTRY_POINTS[entry](ow), call)
        want = expected_of(stock) if entry in entries else stock
        assert got == (TypeError, want), entry
        if entry in entries:
            assert want != stock, "the difference this test records is gone: remove it"


PYTHON_ONLY = ("scale_positional", "eight_positional", "unknown_keyword",
               "unknown_keyword_and_missing_value", "mask_float_keyword", "missing_value",
               "missing_value_keywords", "missing_key_keywords", "missing_all",
               "query_not_a_tensor", "mask_not_a_tensor",
               "value_none")


@pytest.mark.parametrize("case", [c for n, c in CASES.items() if n not in PYTHON_ONLY],
                         ids=[n for n in CASES if n not in PYTHON_ONLY])
def test_op_same_outcome_as_f_sdpa(case):
    """The op itself (its schema also takes scale and enable_gqa by position)."""
    same_outcome(outcome(op_call, case), outcome(F_SDPA, case), "torch.ops.openwam.sdpa")


def test_catalogue_has_both_outcomes():
    """The catalogue holds calls F.sdpa accepts and calls it rejects, with
    several distinct exception types: the comparison above is not vacuous."""
    kinds = [outcome(F_SDPA, c)[0] for c in CASES.values()]
    assert kinds.count("ok") >= 5
    errors = {k for k in kinds if k != "ok"}
    assert {RuntimeError, TypeError} <= errors and len(errors) >= 3
    assert sum(k != "ok" for k in kinds) >= 25


def test_mask_requiring_grad_is_differentiated_as_in_f_sdpa(ow):
    """F.sdpa differentiates an additive mask; so does the op (the call goes
    to PyTorch's implementation)."""
    q, k, v = q_(requires_grad=True), k_(requires_grad=True), v_(requires_grad=True)
    mask = make_mask("additive", B, H, L, S).requires_grad_()
    (dmask,) = torch.autograd.grad(ow.sdpa(q, k, v, mask).sum(), (mask,))
    (stock,) = torch.autograd.grad(F_SDPA(q, k, v, mask).sum(), (mask,))
    torch.testing.assert_close(dmask, stock, atol=0, rtol=0)
    # And both are the mask's gradient: the float64 math backend's.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        (exact,) = torch.autograd.grad(F_SDPA(q, k, v, mask).sum(), (mask,))
    torch.testing.assert_close(dmask, exact, atol=1e-12, rtol=1e-12)


def test_error_leaves_backend_switches_alone(ow):
    """After errors the backend switches are as they were and a valid call works."""
    def switches():
        return (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled())

    before = switches()
    for case in CASES.values():
        outcome(ow.sdpa, case)
    assert switches() == before
    q, k, v = q_(), k_(), v_()
    torch.testing.assert_close(ow.sdpa(q, k, v), F_SDPA(q, k, v), atol=0, rtol=0)


# --------------------------------------------------------------------------
# pad_keys: errors of its own (openwam::pad_keys: argument, expected, got)
# --------------------------------------------------------------------------


def pad(ow, k=None, v=None, mask=None, multiple=128):
    return ow.pad_keys(k_() if k is None else k, v_() if v is None else v, mask, multiple)


PAD_CASES = {
    "multiple_zero": (lambda ow: pad(ow, multiple=0),
                      "multiple must be a positive integer", "got 0"),
    "multiple_negative": (lambda ow: pad(ow, multiple=-64),
                          "multiple must be a positive integer", "got -64"),
    "multiple_overflows": (lambda ow: pad(ow, multiple=2**63 - 1),
                           "multiple must leave the padded length within int64",
                           f"got {2**63 - 1} for 6 keys"),
    "value_length": (lambda ow: pad(ow, v=v_(B, H, S + 2, E)),
                     "value must have the same sequence length as key (6)", "got 8"),
    "mask_integer": (lambda ow: pad(ow, mask=torch.ones(L, S, dtype=torch.int32)),
                     "attn_mask must be bool or floating point", "got Int"),
    "mask_last_dim": (lambda ow: pad(ow, mask=torch.ones(L, S - 1, dtype=torch.bool)),
                      "attn_mask's last dim must be the key length (6) or 1", "got 5"),
    "mask_0d": (lambda ow: pad(ow, mask=torch.tensor(True)),
                "attn_mask must have at least 1 dim", "got 0-D"),
    "key_1d": (lambda ow: pad(ow, k=k_(S), v=v_(S)),
               "key must have at least 2 dims [..., S, E]", "got 1-D"),
    "value_1d": (lambda ow: pad(ow, v=v_(S)),
                 "value must have at least 2 dims [..., S, Ev]", "got 1-D"),
    "value_rank": (lambda ow: pad(ow, v=v_(1, B, H, S, E)),
                   "value must have key's rank (4-D)", "got 5-D"),
}


@pytest.mark.parametrize("case", PAD_CASES.values(), ids=PAD_CASES.keys())
def test_pad_keys_misuse_raises_clear_error(ow, case):
    fn, argument, got = case
    with pytest.raises(RuntimeError, match=re.escape(f"openwam::pad_keys: {argument}") + ".*"
                       + re.escape(got)) as info:
        fn(ow)
    assert "Exception raised from" not in str(info.value)  # one line, no C++ backtrace


# --------------------------------------------------------------------------
# Settings: read once and cached; invalid values raise
# --------------------------------------------------------------------------

ENV_CASES = [
    ("OPENWAM_SDPA_CUDNN", "yes", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_CUDNN", "2", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_CUDNN", "true", "must be unset, '1' or '0'"),
    ("OPENWAM_SDPA_PAD", "sometimes", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_PAD", "ALWAYS", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_PAD", "1", "must be 'auto', 'always' or 'never'"),
    ("OPENWAM_SDPA_CHECK_FINITE", "true", "must be unset, '0' or '1'"),
    ("OPENWAM_SDPA_CHECK_FINITE", "on", "must be unset, '0' or '1'"),
    ("OPENWAM_SDPA_FRONTEND", "no", "must be unset, '0' or '1'"),
]


@pytest.mark.parametrize("name,value,expected", ENV_CASES)
def test_invalid_setting_raises_on_reload_and_after(ow, monkeypatch, name, value, expected):
    """reload_settings() raises, and so does every call until the value is
    fixed: a bad setting is never silently ignored."""
    monkeypatch.setenv(name, value)
    pattern = re.escape(f"openwam::sdpa: environment variable {name} {expected}, got '{value}'")
    with pytest.raises(RuntimeError, match=pattern):
        ow.reload_settings()
    for fn in (ow.sdpa, ow.explain):
        with pytest.raises(RuntimeError, match=pattern):
            fn(q_(), k_(), v_())
    monkeypatch.delenv(name)
    q, k, v = q_(), k_(), v_()
    torch.testing.assert_close(ow.sdpa(q, k, v), F_SDPA(q, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD",
                                  "OPENWAM_SDPA_CHECK_FINITE", "OPENWAM_SDPA_FRONTEND"])
def test_settings_are_cached_until_reload(ow, monkeypatch, name):
    """The environment is read once, not on every call (host time): a change
    takes effect at reload_settings()."""
    before = ow.settings()
    monkeypatch.setenv(name, "bogus")
    assert ow.settings() == before
    ow.sdpa(q_(), k_(), v_())  # still the cached, valid settings
    with pytest.raises(RuntimeError, match=name):
        ow.reload_settings()


@pytest.mark.parametrize("name,value,key,expected", [
    ("OPENWAM_SDPA_CUDNN", "", "cudnn", "follow_pytorch"),
    ("OPENWAM_SDPA_CUDNN", "0", "cudnn", "never"),
    ("OPENWAM_SDPA_CUDNN", "1", "cudnn", "prefer"),
    ("OPENWAM_SDPA_PAD", "", "pad", "auto"),
    ("OPENWAM_SDPA_PAD", "auto", "pad", "auto"),
    ("OPENWAM_SDPA_PAD", "never", "pad", "never"),
    ("OPENWAM_SDPA_PAD", "always", "pad", "always"),
    ("OPENWAM_SDPA_CHECK_FINITE", "", "check_finite", False),
    ("OPENWAM_SDPA_CHECK_FINITE", "0", "check_finite", False),
    ("OPENWAM_SDPA_CHECK_FINITE", "1", "check_finite", True),
    ("OPENWAM_SDPA_FRONTEND", "", "frontend", True),
    ("OPENWAM_SDPA_FRONTEND", "1", "frontend", True),
    ("OPENWAM_SDPA_FRONTEND", "0", "frontend", False),
])
def test_valid_settings_are_accepted(ow, monkeypatch, name, value, key, expected):
    monkeypatch.setenv(name, value)
    assert ow.reload_settings()[key] == expected
    assert ow.settings()[key] == expected
    q, k, v = q_(), k_(), v_()
    torch.testing.assert_close(ow.sdpa(q, k, v), F_SDPA(q, k, v), atol=0, rtol=0)


def test_invalid_setting_does_not_affect_pad_keys(ow, monkeypatch):
    """pad_keys takes no setting: it keeps working."""
    monkeypatch.setenv("OPENWAM_SDPA_PAD", "bogus")
    with pytest.raises(RuntimeError):
        ow.reload_settings()
    kp, _, _ = pad(ow)
    assert kp.shape == (B, H, 128, E)
