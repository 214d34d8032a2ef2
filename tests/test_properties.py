"""Property tests (hypothesis, CPU, float64): random shapes, strides, masks and
settings against an explicit float64 attention reference, and the padding
shim's invariants. Bounded and derandomised, so CI runs the same examples."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support import (  # noqa: E402
    ENV_VARS,
    assert_close,
    expanded_heads,
    fused_qkv,
    gen,
    grads,
    make_mask,
    randn,
    reference_attention,
)

PROFILE = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TOL = 1e-10
KEY_LENGTHS = [1, 2, 3, 5, 8, 13, 64, 127, 128, 129]


@contextlib.contextmanager
def pad_setting(ow, mode):
    """OPENWAM_SDPA_PAD for the block (hypothesis runs many examples in one
    test call, so the function-scoped monkeypatch does not fit)."""
    saved = {name: os.environ.pop(name, None) for name in ENV_VARS}
    if mode is not None:
        os.environ["OPENWAM_SDPA_PAD"] = mode
    ow.reload_settings()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ow.reload_settings()


def tensor(shape, seed, layout):
    """(leaf, view): a float64 tensor of logical shape [B, H, S, E] in the
    given storage, and the autograd leaf it is a view of. "bhsd": contiguous;
    "bshd": a [B, S, H, E] buffer viewed as BHSD; "sliced": a slice of a wider
    [B, S, 3, H, E] buffer (fused projection); "expanded": one head broadcast
    (stride 0) to H. Gradients are taken with respect to the leaf: a tensor
    with stride-0 axes has no well-defined gradient of its own."""
    B, Hh, S, E = shape
    if layout == "bhsd":
        leaf = randn(B, Hh, S, E, seed=seed, requires_grad=True)
        return leaf, leaf
    if layout == "bshd":
        leaf = randn(B, S, Hh, E, seed=seed, requires_grad=True)
        return leaf, leaf.transpose(1, 2)
    if layout == "sliced":
        buf, _, k, _ = fused_qkv(B, Hh, S, E, seed=seed)
        return buf, k
    if layout == "expanded":
        return expanded_heads(B, Hh, S, E, seed=seed)
    raise ValueError(layout)


@st.composite
def attention_calls(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 2))
    Hq = Hkv * group
    L = draw(st.integers(1, 6))
    S = draw(st.sampled_from(KEY_LENGTHS))
    E = draw(st.integers(1, 6))
    Ev = draw(st.sampled_from([E, 3]))
    layouts = st.sampled_from(["bhsd", "bshd", "sliced", "expanded"])
    q_layout, kv_layout = draw(layouts), draw(layouts)
    is_causal = draw(st.integers(0, 4)) == 0  # a mask cannot go with is_causal
    mask_kind = "none" if is_causal else draw(st.sampled_from(
        ["additive", "none", "bool", "key_bool", "key_additive", "rank2", "key_broadcast"]))
    empty_rows = ()
    if mask_kind in ("bool", "additive") and draw(st.booleans()):
        empty_rows = (draw(st.integers(0, L - 1)),)  # a query row that sees no key
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    seed = draw(st.integers(0, 2**16))
    return dict(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, q_layout=q_layout,
                kv_layout=kv_layout, mask_kind=mask_kind, empty_rows=empty_rows,
                is_causal=is_causal, scale=scale, seed=seed, enable_gqa=group > 1)


def build(c):
    """(leaves, (q, k, v), mask) for one drawn call."""
    q_leaf, q = tensor((c["B"], c["Hq"], c["L"], c["E"]), c["seed"], c["q_layout"])
    k_leaf, k = tensor((c["B"], c["Hkv"], c["S"], c["E"]), c["seed"] + 1, c["kv_layout"])
    v_leaf, v = tensor((c["B"], c["Hkv"], c["S"], c["Ev"]), c["seed"] + 2, c["kv_layout"])
    kind = c["mask_kind"]
    if kind == "rank2":
        mask = make_mask("bool", c["B"], c["Hq"], c["L"], c["S"], rank=2, seed=c["seed"])
    else:
        mask = make_mask(kind, c["B"], c["Hq"], c["L"], c["S"], seed=c["seed"],
                         empty_rows=c["empty_rows"])
    return (q_leaf, k_leaf, v_leaf), (q, k, v), mask


@pytest.mark.parametrize("pad", [None, "auto", "always", "never"])
@settings(max_examples=30, **PROFILE)
@given(c=attention_calls())
@example(c=dict(B=2, Hq=4, Hkv=2, L=5, S=9, E=4, Ev=3, q_layout="bshd", kv_layout="sliced",
                mask_kind="additive", empty_rows=(2,), is_causal=False, scale=0.7,
                seed=5, enable_gqa=True))
@example(c=dict(B=1, Hq=2, Hkv=2, L=3, S=129, E=8, Ev=8, q_layout="bhsd", kv_layout="expanded",
                mask_kind="bool", empty_rows=(0,), is_causal=False, scale=None,
                seed=9, enable_gqa=False))
def test_sdpa_matches_float64_reference(ow, pad, c):
    leaves, (q, k, v), mask = build(c)
    kw = dict(is_causal=c["is_causal"], scale=c["scale"], enable_gqa=c["enable_gqa"])
    with pad_setting(ow, pad):
        info = ow.explain(q, k, v, mask, **kw)
        out = ow.sdpa(q, k, v, mask, **kw)
    for name in ("mask_kind", "kv_layout"):
        event(f"{name}={c[name]}")  # shown by --hypothesis-show-statistics
    event(f"plan={info['plan']}")
    for name in ("empty_rows", "is_causal", "enable_gqa"):
        if c[name]:
            event(name)
    # On the CPU every call is PyTorch's own, whatever the pad setting.
    assert info["route"] == "pytorch" and info["plan"] == "none"

    ref = reference_attention(q, k, v, mask, **kw)
    assert out.shape == ref.shape
    assert_close(out, ref, TOL, TOL, what="output")
    if c["empty_rows"]:  # a row that sees no key: zero output, zero dQ
        (dq,) = grads(out, (q,), retain_graph=True)
        for r in c["empty_rows"]:
            assert torch.count_nonzero(out[..., r, :]) == 0
            assert torch.count_nonzero(dq[..., r, :]) == 0
    g, ref_g = grads(out, leaves), grads(ref, leaves)
    for name, a, b in zip(("dq", "dk", "dv"), g, ref_g):
        assert_close(a, b, TOL, TOL, what=name)


# --------------------------------------------------------------------------
# The shim's invariants
# --------------------------------------------------------------------------


def layout_signature(t, sizes):
    """Which axes are broadcast (stride 0), and the order of the others from
    outermost to innermost; axes of size 1 (in `sizes`, the input's) carry no
    layout."""
    dims = [d for d in range(t.dim()) if sizes[d] > 1]
    broadcast = tuple(d for d in dims if t.stride(d) == 0)
    order = tuple(sorted((d for d in dims if t.stride(d) != 0), key=lambda d: -t.stride(d)))
    return broadcast, order


@st.composite
def shim_calls(draw):
    rank = draw(st.sampled_from([3, 4]))
    B, Hh = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 4)), draw(st.sampled_from(KEY_LENGTHS))
    E = draw(st.integers(1, 5))
    layout = draw(st.sampled_from(["bhsd", "bshd", "sliced", "expanded"]))
    mask_kind = draw(st.sampled_from(
        ["none", "bool", "additive", "key_bool", "key_additive", "key_broadcast", "rank2"]))
    multiple = draw(st.sampled_from([1, 2, 7, 16, 64, 128, 200]))
    seed = draw(st.integers(0, 2**16))
    return dict(rank=rank, B=B, H=Hh, L=L, S=S, E=E, layout=layout,
                mask_kind=mask_kind, multiple=multiple, seed=seed)


@settings(max_examples=80, **PROFILE)
@given(shim_calls())
def test_pad_keys_invariants(ow, c):
    B, Hh, L, S, E = c["B"], c["H"], c["L"], c["S"], c["E"]
    k_leaf, k = tensor((B, Hh, S, E), c["seed"], c["layout"])
    v_leaf, v = tensor((B, Hh, S, E + 1), c["seed"] + 1, c["layout"])
    q = torch.randn(B, Hh, L, E, generator=gen(c["seed"] + 2), dtype=torch.float64)
    q = q.requires_grad_()
    kind = c["mask_kind"]
    mask = (make_mask("bool", B, Hh, L, S, rank=2, seed=c["seed"]) if kind == "rank2"
            else make_mask(kind, B, Hh, L, S, seed=c["seed"]))
    if c["rank"] == 3:  # [B*H, S, E] calls; masks lose their head axis
        k, v, q = (t.flatten(0, 1) for t in (k, v, q))
        if mask is not None and mask.dim() == 4:
            mask = mask.expand(B, Hh, *mask.shape[2:]).flatten(0, 1)
    leaves = (q, k_leaf, v_leaf)

    kp, vp, mp = ow.pad_keys(k, v, mask, c["multiple"])
    S_pad = math.ceil(S / c["multiple"]) * c["multiple"]

    # Shapes: only the key axis grows; the rank is kept.
    assert kp.shape == k.shape[:-2] + (S_pad, E)
    assert vp.shape == v.shape[:-2] + (S_pad, E + 1)
    assert mp.shape[-1] == S_pad
    if mask is not None:
        assert mp.dim() == mask.dim() and mp.dtype == mask.dtype
        assert mp.shape[:-1] == mask.shape[:-1]
    else:
        assert mp.shape == (1, S_pad) and mp.dtype == torch.bool
    if S_pad == S:
        assert kp.data_ptr() == k.data_ptr() and vp.data_ptr() == v.data_ptr()

    # Layout kept: the same broadcast axes and stride order, unit last stride.
    for orig, padded in ((k, kp), (v, vp)):
        assert layout_signature(padded, orig.shape) == layout_signature(orig, orig.shape)
        assert padded.stride(-1) == 1

    # Values: originals first, zeros after; the mask hides exactly the tail.
    assert torch.equal(kp[..., :S, :], k) and torch.equal(vp[..., :S, :], v)
    assert torch.count_nonzero(kp[..., S:, :]) == 0
    assert torch.count_nonzero(vp[..., S:, :]) == 0
    if mp.dtype == torch.bool:
        assert not mp[..., S:].any()
    else:
        assert torch.all(mp[..., S:] == float("-inf"))
    if mask is not None:
        assert torch.equal(mp[..., :S], mask.expand(*mask.shape[:-1], S))

    # Attention over the padded keys is attention over the originals, and
    # dK/dV come back at the caller's key length.
    ref = reference_attention(q, k, v, mask)
    out = reference_attention(q, kp, vp, mp)
    assert_close(out, ref, 1e-12, what="output")
    for a, b in zip(grads(out, leaves, retain_graph=True), grads(ref, leaves)):
        assert_close(a, b, 1e-12, what="grad")
    # Through pad_keys, dK/dV come back at the caller's key length.
    dk, dv = grads(out, (k, v))
    assert dk.shape == k.shape and dv.shape == v.shape
