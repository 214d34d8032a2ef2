"""openwam_sdpa.sdpa on CPU is a drop-in for F.scaled_dot_product_attention.

On CPU the op runs PyTorch's own selection, so outputs and gradients must be
what F.sdpa gives (float64/float32: to rounding; bf16: within twice F.sdpa's
own error against a float64 reference), across mask kinds, causal calls,
scale, GQA, dropout, ranks and layouts, edge cases and non-finite inputs. The
op is also checked with torch.library.opcheck and gradcheck, and explain()
must describe what the call does.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from support import (
    F_SDPA,
    MASK_KINDS,
    assert_close,
    assert_within_stock,
    expanded_heads,
    fused_qkv,
    grads,
    make_mask,
    qkv,
    randn,
    reference,
    reference_attention,
    run,
)

B, H, L, S, E = 2, 3, 6, 10, 8
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}

MASK_CASES = [(k, 4) for k in MASK_KINDS] + [("bool", 2), ("additive", 2)]


def mask_id(m):
    return f"{m[0]}-rank{m[1]}"


def compare(ow, q, k, v, mask=None, inputs=None, tol=1e-12, **kw):
    """ow.sdpa vs F.sdpa on the same tensors: outputs and gradients of
    `inputs` (default q, k, v)."""
    inputs = (q, k, v) if inputs is None else inputs
    ref = F_SDPA(q, k, v, attn_mask=mask, **kw)
    out = ow.sdpa(q, k, v, attn_mask=mask, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, tol, tol, what="output")
    if any(t.requires_grad for t in inputs):
        for i, (a, b) in enumerate(zip(grads(out, inputs), grads(ref, inputs))):
            assert a.shape == b.shape
            assert_close(a, b, tol, tol, what=f"grad {i}")
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mask_case", MASK_CASES, ids=mask_id)
def test_matches_f_sdpa_masks(ow, dtype, mask_case):
    kind, rank = mask_case
    q, k, v = qkv(B, H, L, S, E, dtype=dtype, requires_grad=True)
    mask = make_mask(kind, B, H, L, S, dtype=dtype, rank=rank)
    compare(ow, q, k, v, mask, tol=TOL[dtype])


CALLS = {
    "causal_sq_lt_skv": dict(L=4, S=9, is_causal=True),
    "causal_sq_gt_skv": dict(L=9, S=4, is_causal=True),
    "causal_square": dict(L=7, S=7, is_causal=True),
    "scale": dict(scale=0.17),
    "scale_large": dict(scale=3.0),
    "gqa": dict(Hq=4, Hkv=2, enable_gqa=True),
    "gqa_bool_mask": dict(Hq=4, Hkv=2, enable_gqa=True, mask="bool"),
    "gqa_causal": dict(Hq=4, Hkv=1, enable_gqa=True, is_causal=True),
    "value_head_dim_differs": dict(Ev=5),
    "bshd": dict(layout="bshd", mask="additive"),
    "s_kv_1": dict(S=1),
    "s_kv_127": dict(S=127, mask="bool"),
    "s_kv_128": dict(S=128, mask="bool"),
    "s_kv_256": dict(S=256),
    "s_q_1": dict(L=1, mask="key_bool"),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_matches_f_sdpa_calls(ow, dtype, call):
    c = dict(call)
    Hq, Hkv, Ev = c.pop("Hq", H), c.pop("Hkv", None), c.pop("Ev", None)
    Lq, Skv = c.pop("L", L), c.pop("S", S)
    layout, kind = c.pop("layout", "bhsd"), c.pop("mask", "none")
    q, k, v = qkv(B, Hq, Lq, Skv, E, Hkv=Hkv, Ev=Ev, dtype=dtype, layout=layout,
                  requires_grad=True)
    mask = make_mask(kind, B, Hq, Lq, Skv, dtype=dtype)
    compare(ow, q, k, v, mask, tol=TOL[dtype], **c)


@pytest.mark.parametrize("kind", ["none", "bool", "additive", "causal"])
def test_matches_f_sdpa_3d(ow, kind):
    q = randn(4, L, E, requires_grad=True)
    k = randn(4, S, E, seed=1, requires_grad=True)
    v = randn(4, S, E, seed=2, requires_grad=True)
    kw = {"is_causal": True} if kind == "causal" else {}
    mask = None if kind in ("none", "causal") else make_mask(kind, 4, 1, L, S)[:, 0]
    out = compare(ow, q, k, v, mask, **kw)
    assert out.dim() == 3


def test_matches_f_sdpa_fused_qkv_buffer(ow):
    buf, q, k, v = fused_qkv(B, H, S, E)
    mask = make_mask("bool", B, H, S, S)
    compare(ow, q, k, v, mask, inputs=(buf,))


def test_matches_f_sdpa_expanded_heads(ow):
    kb, k = expanded_heads(B, H, S, E, seed=1)
    vb, v = expanded_heads(B, H, S, E, seed=2)
    q = randn(B, H, L, E, requires_grad=True)
    compare(ow, q, k, v, make_mask("additive", B, H, L, S), inputs=(q, kb, vb))


@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_bf16_within_twice_f_sdpa_error(ow, kind):
    """The error rule (support.rule_violation), against the float64
    reference of the bf16 values. Measured here: F.sdpa's own error
    2.2e-3..4.3e-3, bound 5.7e-3..1.1e-2, ours equal to F.sdpa bit for bit.
    (The rule's earlier form here, the reference of the float64 values before
    rounding and a floor of 1e-3, gave bounds of 9.7e-3..1.7e-2 on the same
    draws: looser for all twelve tensors.)"""
    q, k, v = qkv(B, H, L, 40, 16, dtype=torch.bfloat16, requires_grad=True)
    mask = make_mask(kind, B, H, L, 40, dtype=torch.bfloat16)
    go = randn(B, H, L, 16, dtype=torch.bfloat16, seed=11)
    ref, _ = reference(q, k, v, go, attn_mask=mask)
    ours, stock = run(ow.sdpa, q, k, v, go, attn_mask=mask), run(F_SDPA, q, k, v, go, attn_mask=mask)
    assert all(t.dtype == torch.bfloat16 for t in ours)
    assert_within_stock(ours, stock, ref, torch.bfloat16)


# --------------------------------------------------------------------------
# Against the float64 reference and gradcheck
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "bool", "additive", "key_bool"])
def test_matches_float64_reference(ow, kind):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    mask = make_mask(kind, B, H, L, S)
    out = ow.sdpa(q, k, v, mask)
    ref = reference_attention(q, k, v, mask)
    assert_close(out, ref, 1e-12, what="output")
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert_close(a, b, 1e-12, what="grad")


GRADCHECK = {
    "none": dict(),
    "bool": dict(mask="bool"),
    "additive": dict(mask="additive"),
    "causal": dict(is_causal=True),
    "gqa_scale": dict(Hq=4, Hkv=2, enable_gqa=True, scale=0.5),
}


@pytest.mark.parametrize("call", GRADCHECK.values(), ids=GRADCHECK.keys())
def test_gradcheck(ow, call):
    c = dict(call)
    Hq, Hkv, kind = c.pop("Hq", 2), c.pop("Hkv", None), c.pop("mask", "none")
    q, k, v = qkv(1, Hq, 3, 5, 4, Hkv=Hkv, requires_grad=True)
    mask = make_mask(kind, 1, Hq, 3, 5)

    def fn(q, k, v):
        return ow.sdpa(q, k, v, mask, **c)

    assert torch.autograd.gradcheck(fn, (q, k, v))


# --------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind", ["none", "bool", "additive", "key_bool", "rank2"])
def test_opcheck_sdpa(ow, kind, requires_grad):
    q, k, v = qkv(2, 2, 3, 5, 4, requires_grad=requires_grad)
    mask = (make_mask("bool", 2, 2, 3, 5, rank=2) if kind == "rank2"
            else make_mask(kind, 2, 2, 3, 5))
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v, mask))


def test_opcheck_sdpa_causal_gqa_scale(ow):
    q, k, v = qkv(1, 4, 3, 5, 4, Hkv=2, requires_grad=True)
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v),
                          {"is_causal": True, "scale": 0.3, "enable_gqa": True})


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_opcheck_pad_keys(ow, kind, requires_grad):
    k = randn(2, 2, 5, 4, requires_grad=requires_grad)
    v = randn(2, 2, 5, 4, seed=1, requires_grad=requires_grad)
    mask = make_mask(kind, 2, 2, 3, 5)
    torch.library.opcheck(torch.ops.openwam.pad_keys.default, (k, v, mask, 16))


def test_python_wrapper_is_the_op(ow):
    q, k, v = qkv(B, H, L, S, E)
    mask = make_mask("bool", B, H, L, S)
    a = ow.sdpa(q, k, v, mask, 0.0, False, scale=0.4)
    b = torch.ops.openwam.sdpa(q, k, v, mask, 0.0, False, 0.4)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_dropout_seeded_equal_to_f_sdpa(ow, dtype, requires_grad):
    q, k, v = qkv(B, H, L, S, E, dtype=dtype, requires_grad=requires_grad)
    info = ow.explain(q, k, v, dropout_p=0.3)
    assert info["plan"] == "none"  # same path as F.sdpa: same random stream
    torch.manual_seed(123)
    ref = F_SDPA(q, k, v, dropout_p=0.3)
    torch.manual_seed(123)
    out = ow.sdpa(q, k, v, dropout_p=0.3)
    assert torch.equal(out, ref)
    if requires_grad:
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
            assert torch.equal(a, b)


def test_dropout_changes_output_and_stays_finite(ow):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    plain = ow.sdpa(q, k, v)
    out = ow.sdpa(q, k, v, dropout_p=0.5)
    assert out.shape == plain.shape
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, plain)
    assert all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))


def test_dropout_with_pad_always_is_f_sdpa_on_cpu(ow, settings):
    """PAD=always concerns the cuDNN path only: on the CPU a dropout call is
    PyTorch's own, the same random stream included."""
    settings(pad="always")
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    assert ow.explain(q, k, v, dropout_p=0.25)["plan"] == "none"
    torch.manual_seed(7)
    out = ow.sdpa(q, k, v, dropout_p=0.25)
    torch.manual_seed(7)
    ref = F_SDPA(q, k, v, dropout_p=0.25)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------
# Fully masked rows, edge cases, non-finite inputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pad", ["auto", "always"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_give_zero(ow, settings, kind, pad):
    settings(pad=pad)
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    mask = make_mask(kind, B, H, L, S, empty_rows=(0, 4))
    out = ow.sdpa(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[..., [0, 4], :]) == 0
    dq, dk, dv = grads(out, (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.count_nonzero(dq[..., [0, 4], :]) == 0
    ref = reference_attention(q, k, v, mask)
    assert_close(out, ref, 1e-12, what="output")
    for a, b in zip((dq, dk, dv), grads(ref, (q, k, v))):
        assert_close(a, b, 1e-12, what="grad")


EDGES = {
    "empty_batch": (0, 2, 3, 5),
    "zero_length_query": (1, 2, 0, 5),
    "zero_heads": (1, 0, 3, 5),
    "zero_length_keys": (1, 2, 3, 0),
    "s_kv_1": (2, 2, 3, 1),
    "s_kv_lt_128": (1, 2, 3, 77),
    "s_kv_128": (1, 2, 3, 128),
    "s_kv_384": (1, 1, 2, 384),
}


@pytest.mark.parametrize("pad", ["auto", "always"])
@pytest.mark.parametrize("shape", EDGES.values(), ids=EDGES.keys())
def test_edge_cases_match_reference(ow, settings, shape, pad):
    """Against the float64 reference, not F.sdpa: stock F.sdpa of torch 2.11
    dies of SIGFPE on zero heads on CPU (pytorch #174939; it killed this
    suite on the H200 machine, 2026-11-30). Empty inputs take PyTorch's math
    backend inside openwam::sdpa, which returns zeros there."""
    settings(pad=pad)
    b, h, lq, skv = shape
    q, k, v = qkv(b, h, lq, skv, 4, requires_grad=True)
    ref = reference_attention(q, k, v)
    out = ow.sdpa(q, k, v)
    assert out.shape == ref.shape == (b, h, lq, 4)
    assert_close(out, ref, 1e-12, what="output")
    for a, b_ in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert_close(a, b_, 1e-12, what="grad")
    if 0 in shape:
        assert "empty" in ow.explain(q, k, v)["reason"]


EMPTY_BEYOND_MATH = {
    # Shapes PyTorch's math backend refuses; its fused CPU kernel answers the
    # empty call (torch 2.13: an empty output).
    "mask_not_broadcasting": ((0, 2, 3, 8), (0, 2, 5, 8), (7, 9), False),
    "mask_wrong_keys": ((1, 2, 0, 8), (1, 2, 5, 8), (2, 2), False),
    "query_heads_over_kv": ((0, 4, 3, 8), (0, 2, 5, 8), None, False),
    "gqa_not_dividing": ((0, 3, 3, 8), (0, 2, 5, 8), None, True),
    "no_keys_more_heads": ((1, 4, 3, 8), (1, 2, 0, 8), None, False),
    "head_dim_0_more_heads": ((1, 4, 3, 0), (1, 2, 5, 0), None, False),
    "3d_mask_not_broadcasting": ((0, 3, 8), (0, 5, 8), (4, 4), False),
    "batch_unlike_keys": ((2, 2, 3, 8), (0, 2, 5, 8), None, False),
    "head_dim_unlike_keys": ((0, 2, 3, 8), (0, 2, 5, 4), None, False),
    # Zero heads do not make a shape the math backend's (found in review).
    "zero_heads_mask_not_broadcasting": ((2, 0, 3, 4), (2, 0, 5, 4), (7, 7), False),
    # Grouped-query attention reads dim -3.
    "2d_gqa": ((0, 2), (0, 2), None, True),
}


def _outcome(fn, *args, **kwargs):
    try:
        return tuple(fn(*args, **kwargs).shape)
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception
        return type(e).__name__, str(e)


@pytest.mark.parametrize("q_shape,kv_shape,mask_shape,gqa", EMPTY_BEYOND_MATH.values(),
                         ids=EMPTY_BEYOND_MATH.keys())
def test_empty_calls_beyond_the_math_backend_are_stocks(ow, q_shape, kv_shape, mask_shape, gqa):
    """Empty CPU calls run on the math backend only where it takes their
    shapes; the rest get F.sdpa's own answer, output or error (the math
    route raised where F.sdpa returned; found in review)."""
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    mask = None if mask_shape is None else torch.zeros(mask_shape)
    stock = _outcome(F_SDPA, q, k, v, mask, enable_gqa=gqa)
    assert _outcome(ow.sdpa, q, k, v, mask, enable_gqa=gqa) == stock


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_empty_value_heads_are_stocks(ow, gqa):
    """Value with zero heads beside key heads: F.sdpa answers (zeros on torch
    2.13-2.15); the math backend's head grouping would divide by zero (it
    killed the process with SIGFPE under enable_gqa; found in review)."""
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 0, 3, 4)
    assert _outcome(ow.sdpa, q, k, v, enable_gqa=gqa) == _outcome(F_SDPA, q, k, v,
                                                                  enable_gqa=gqa)


def test_edge_case_empty_batch_with_mask(ow, settings):
    settings(pad="always")
    q, k, v = qkv(0, 2, 3, 5, 4, requires_grad=True)
    mask = torch.ones(0, 1, 3, 5, dtype=torch.bool)
    out = ow.sdpa(q, k, v, mask)
    assert out.shape == (0, 2, 3, 4)


def test_empty_head_dim_with_bool_mask_hides_keys(ow):
    """Before torch 2.13 empty CPU calls run on PyTorch's math backend, which
    adds a mask to the scores as it is: a bool mask has to become 0 / -inf
    first, as PyTorch's entry makes it (before, True added 1 and nothing was
    hidden: 1.38 off); from torch 2.13 F.sdpa answers them, the same.
    With head_dim 0 every score is equal, so each row is the mean of the
    values its mask shows: F.sdpa's answer on torch 2.11 and 2.13 (torch
    2.12's F.sdpa returns zeros for head_dim 0, with or without a mask)."""
    q, k = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 5, 0)
    v = torch.randn(1, 2, 5, 8)
    shown = torch.tensor([True, False, True, False, False])
    mask = shown.expand(4, 5)
    want = v[:, :, shown].mean(dim=2, keepdim=True).expand(1, 2, 4, 8)
    assert_close(ow.sdpa(q, k, v, mask), want, 1e-6, what="output")
    additive = torch.zeros(4, 5).masked_fill(~mask, float("-inf"))
    assert_close(ow.sdpa(q, k, v, additive), want, 1e-6, what="output, additive mask")


EMPTY_WITH_MASK_AND_CAUSAL = {
    "empty_batch": ((0, 2, 3, 4), (0, 2, 5, 4), (0, 2, 5, 4)),
    "zero_length_query": ((1, 2, 0, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
    "zero_heads": ((1, 0, 3, 4), (1, 0, 5, 4), (1, 0, 5, 4)),
    # head_dim 0 with an empty output (found in review: the op raised where
    # torch 2.13's F.sdpa returns).
    "empty_batch_head_dim_0": ((0, 2, 3, 0), (0, 2, 3, 0), (0, 2, 3, 0)),
    "zero_length_head_dim_0": ((1, 2, 0, 0), (1, 2, 0, 0), (1, 2, 0, 0)),
    "value_head_dim_0": ((1, 2, 3, 0), (1, 2, 5, 0), (1, 2, 5, 0)),
    "only_value_head_dim_0": ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 0)),
}


@pytest.mark.parametrize("q_shape,k_shape,v_shape", EMPTY_WITH_MASK_AND_CAUSAL.values(),
                         ids=EMPTY_WITH_MASK_AND_CAUSAL.keys())
def test_empty_call_with_mask_and_is_causal_as_f_sdpa(ow, q_shape, k_shape, v_shape):
    """An empty call with a mask and is_causal gets F.sdpa's answer, which
    differs between releases: an empty output on torch 2.13's CPU build,
    "Explicit attn_mask should not be set when is_causal=True" on 2.14 and
    2.15. The op's math route had folded is_causal into the mask (it returned
    where 2.14 raises, raised at head_dim 0 where 2.13 returns, and built an
    L x S mask for an empty batch; found in review): PyTorch answers every
    empty call from torch 2.13."""
    q, k, v = (torch.randn(s, requires_grad=True) for s in (q_shape, k_shape, v_shape))
    for mask in (torch.ones(q_shape[-2], k_shape[-2], dtype=torch.bool),
                 torch.zeros(q_shape[-2], k_shape[-2])):
        stock = _outcome(F_SDPA, q, k, v, mask, is_causal=True)
        assert _outcome(ow.sdpa, q, k, v, mask, is_causal=True) == stock
        if isinstance(stock[0], int):  # an output: its gradients have the inputs' shapes
            out = ow.sdpa(q, k, v, mask, is_causal=True)
            assert all(g.shape == t.shape for g, t in zip(grads(out, (q, k, v)), (q, k, v)))


def test_head_dim_0_with_mask_and_is_causal_raises_as_f_sdpa(ow):
    """At head_dim 0 with an output to compute F.sdpa takes its math backend
    itself, which refuses a mask with is_causal: so does the op."""
    q, k = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 5, 0)
    v = torch.randn(1, 2, 5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError) as stock:
        F_SDPA(q, k, v, mask, is_causal=True)
    with pytest.raises(type(stock.value), match=re.escape(str(stock.value))):
        ow.sdpa(q, k, v, mask, is_causal=True)


@pytest.mark.parametrize("q_heads", [0, 2])
def test_gqa_over_zero_kv_heads_as_f_sdpa(ow, q_heads):
    """The math backend's head grouping divides by the key/value heads: with
    none it died of SIGFPE. torch 2.13's F.sdpa answers; so does the op."""
    q, k = torch.randn(1, q_heads, 4, 8), torch.randn(1, 0, 5, 8)
    out = ow.sdpa(q, k, k, enable_gqa=True)
    assert_close(out, F_SDPA(q, k, k, enable_gqa=True), 0.0,
                 what="output")


NONFINITE = {
    "nan_query_row": ("q", (0, 1, 2), float("nan")),
    "inf_query_elem": ("q", (0, 1, 2, 0), float("inf")),
    "nan_key_row": ("k", (1, 0, 3), float("nan")),
    "inf_key_elem": ("k", (1, 0, 3, 1), float("-inf")),
    "nan_value_row": ("v", (0, 2, 4), float("nan")),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", NONFINITE.values(), ids=NONFINITE.keys())
def test_non_finite_inputs_propagate_as_in_f_sdpa(ow, case, dtype):
    which, index, value = case
    q, k, v = qkv(B, H, L, S, E, dtype=dtype)
    {"q": q, "k": k, "v": v}[which][index] = value
    ref = F_SDPA(q, k, v)
    out = ow.sdpa(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close(out, ref, TOL[dtype], TOL[dtype], what="output")


def test_nan_query_row_with_math_backend_gives_nan_row(ow):
    """With PyTorch's math backend a NaN query row gives a NaN output row,
    other rows untouched. (PyTorch's CPU flash kernel, the default on CPU,
    returns zeros for that row instead; the op follows whichever runs.)"""
    q, k, v = qkv(B, H, L, S, E)
    q[0, 1, 2] = float("nan")
    with sdpa_kernel(SDPBackend.MATH):
        out = ow.sdpa(q, k, v)
    assert torch.isnan(out[0, 1, 2]).all()
    assert torch.isnan(out).sum() == E


# --------------------------------------------------------------------------
# explain()
# --------------------------------------------------------------------------

EXPLAIN_KEYS = {"route", "backend", "pytorch_choice", "plan", "engine", "rule", "reason",
                "differentiated", "settings", "cudnn_runtime"}


def test_explain_defaults_on_cpu(ow):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    info = ow.explain(q, k, v)
    assert EXPLAIN_KEYS <= set(info)
    assert info["route"] == info["backend"] == "pytorch"
    assert info["plan"] == "none" and info["rule"] == ""
    assert info["engine"] == ""  # which cuDNN runs: named on the cuDNN route only
    assert info["settings"] == {"cudnn": "follow_pytorch", "pad": "auto", "check_finite": False,
                                 "frontend": True}
    assert info["reason"] == "inputs are not on a CUDA device"
    # No cuDNN on the CPU: PyTorch's selector need not be asked.
    assert info["pytorch_choice"] == "not asked"


@pytest.mark.parametrize("cudnn,route,reason", [
    ("1", "pytorch", "inputs are not on a CUDA device"),
    ("0", "pytorch", "OPENWAM_SDPA_CUDNN=0"),  # no cuDNN to switch off on the CPU
])
def test_explain_cudnn_setting_on_cpu(ow, settings, cudnn, route, reason):
    settings(cudnn=cudnn)
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    info = ow.explain(q, k, v)
    assert info["route"] == route and info["plan"] == "none" and info["engine"] == ""
    assert info["settings"]["cudnn"] == {"1": "prefer", "0": "never"}[cudnn]
    assert info["reason"] == reason
    compare(ow, q, k, v)


def test_explain_differentiated_needs_grad_mode_and_requires_grad(ow):
    q, k, v = qkv(B, H, L, S, E)
    assert ow.explain(q, k, v)["differentiated"] is False  # grad mode, no requires_grad
    for t in (q, k, v):
        t.requires_grad_(True)
        assert ow.explain(q, k, v)["differentiated"] is True
        with torch.no_grad():  # requires_grad, grad mode off
            assert ow.explain(q, k, v)["differentiated"] is False
        with torch.inference_mode():
            assert ow.explain(q, k, v)["differentiated"] is False
        t.requires_grad_(False)


def test_explain_never_raises_for_input_the_op_hands_to_pytorch(ow):
    """explain() reports; PyTorch's error comes from the call itself."""
    q, k, v = qkv(B, H, L, S, E)
    assert ow.explain(q, k[..., :4], v)["route"] == "pytorch"
    with pytest.raises(RuntimeError) as ours:
        ow.sdpa(q, k[..., :4], v)
    with pytest.raises(RuntimeError) as stock:
        F_SDPA(q, k[..., :4], v)
    assert str(ours.value) == str(stock.value)


def test_check_finite_setting_is_harmless_on_cpu(ow, settings):
    settings(check_finite="1")
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    compare(ow, q, k, v, make_mask("bool", B, H, L, S))


# --------------------------------------------------------------------------
# Modes: inference, no_grad, double backward
# --------------------------------------------------------------------------


def test_inference_mode_and_no_grad(ow):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    mask = make_mask("bool", B, H, L, S)
    ref = F_SDPA(q, k, v, mask).detach()
    with torch.inference_mode():
        out = ow.sdpa(q, k, v, mask)
    assert torch.equal(out, ref)
    with torch.no_grad():
        out = ow.sdpa(q, k, v, mask)
    assert out.grad_fn is None and torch.equal(out, ref)


def double_backward(fn, q, k, v):
    out = fn(q, k, v)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return torch.autograd.grad(dq.sum(), (q, k, v))


def test_double_backward_behaves_as_f_sdpa(ow):
    """PyTorch's default CPU kernel (flash) has no double backward; whatever
    F.sdpa does, the op must do the same: both work and agree, or both raise
    the same clear error."""
    q, k, v = qkv(1, 2, 3, 5, 4, requires_grad=True)
    try:
        ref = double_backward(F_SDPA, q, k, v)
    except RuntimeError as exc:
        msg = str(exc).splitlines()[0]
        with pytest.raises(RuntimeError, match="not implemented") as info:
            double_backward(ow.sdpa, q, k, v)
        assert str(info.value).splitlines()[0] == msg
    else:
        for a, b in zip(double_backward(ow.sdpa, q, k, v), ref):
            assert_close(a, b, 1e-12, what="double backward")


def test_double_backward_on_math_backend(ow):
    q, k, v = qkv(1, 2, 3, 5, 4, requires_grad=True)
    mask = make_mask("bool", 1, 2, 3, 5)
    with sdpa_kernel(SDPBackend.MATH):
        ours = double_backward(lambda q, k, v: ow.sdpa(q, k, v, mask), q, k, v)
        ref = double_backward(lambda q, k, v: F_SDPA(q, k, v, mask), q, k, v)
        for a, b in zip(ours, ref):
            assert_close(a, b, 1e-12, what="double backward")
        assert torch.autograd.gradgradcheck(lambda q, k, v: ow.sdpa(q, k, v, mask), (q, k, v))


# --------------------------------------------------------------------------
# PyTorch's switches behave as with F.sdpa: autocast, sdpa_kernel, determinism
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_autocast_casts_like_f_sdpa(ow, mask_kind):
    """F.sdpa is on autocast's lower-precision list (a float mask is cast
    too): under torch.autocast the op gives F.sdpa's dtype and values."""
    q, k, v = qkv(B, H, L, S, E, dtype=torch.float32, requires_grad=True)
    mask = make_mask(mask_kind, B, H, L, S, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F_SDPA(q, k, v, mask)
        out = ow.sdpa(q, k, v, mask)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_sdpa_kernel_restrictions_are_pytorchs(ow):
    """sdpa_kernel restricts the op as it restricts F.sdpa: the same result
    where the allowed backend serves, the same error and message where it
    cannot (on the CPU, efficient and cuDNN attention serve nothing)."""
    q, k, v = qkv(B, H, L, S, E)
    mask = make_mask("additive", B, H, L, S)
    outcomes = set()
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION],
                     [SDPBackend.EFFICIENT_ATTENTION], [SDPBackend.CUDNN_ATTENTION]):
        with sdpa_kernel(backends):
            try:
                expected = ("ok", F_SDPA(q, k, v, mask))
            except RuntimeError as e:
                expected = ("error", str(e))
            try:
                got = ("ok", ow.sdpa(q, k, v, mask))
            except RuntimeError as e:
                got = ("error", str(e))
        assert got[0] == expected[0], (backends, got, expected)
        outcomes.add(got[0])
        if got[0] == "ok":
            assert torch.equal(got[1], expected[1])
        else:
            assert got[1] == expected[1]
    assert outcomes == {"ok", "error"}  # both kinds compared


def test_deterministic_mode_is_pytorchs(ow):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for warn_only in (False, True):
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
            ref = F_SDPA(q, k, v)
            out = ow.sdpa(q, k, v)
            assert torch.equal(out, ref)
            for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
                assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(was)
