"""The padding shim on CPU, in float64: pad_keys(...) changes nothing.

Attention over pad_keys(key, value, mask) must equal attention over the
unpadded inputs (outputs and dQ/dK/dV), the padded keys must get exactly zero
gradient, and the physical layout of the inputs (BSHD storage, stride-0
broadcast axes, key-only masks) must survive the padding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from support import (
    assert_close,
    expanded_heads,
    fused_qkv,
    grads,
    make_mask,
    qkv,
    randn,
    reference_attention,
)

TOL = 1e-12
B, H, L, E = 2, 3, 5, 8


def math_sdpa(q, k, v, attn_mask=None, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)


ATTENTION = {"reference": reference_attention, "F.sdpa-math": math_sdpa}

# (kind, rank) of the masks the shim takes.
MASKS = [
    ("none", 4),
    ("bool", 4),
    ("additive", 4),
    ("bool", 2),
    ("additive", 2),
    ("key_bool", 4),
    ("key_additive", 4),
    ("key_broadcast", 4),
]


def mask_id(m):
    return f"{m[0]}-rank{m[1]}"


def padded_equals_unpadded(ow, attend, q, k, v, mask, multiple=128):
    """Asserts that attention over the padded keys equals attention over the
    originals, in outputs and in gradients (through pad_keys and of the padded
    tensors themselves); returns the padded (key, value, mask)."""
    s_kv = k.shape[-2]
    ref = attend(q, k, v, mask)
    ref_g = grads(ref, (q, k, v))

    kp, vp, mp = ow.pad_keys(k, v, mask, multiple)
    assert kp.shape[-2] == vp.shape[-2] == mp.shape[-1] == (
        math.ceil(s_kv / multiple) * multiple)
    out = attend(q, kp, vp, mp)
    g = grads(out, (q, k, v))
    assert_close(out, ref, TOL, what="output")
    for name, a, b in zip(("dq", "dk", "dv"), g, ref_g):
        assert a.shape == b.shape
        assert_close(a, b, TOL, what=name)

    # The padded tensors as leaves: their tail gets exactly zero gradient.
    kl, vl = kp.detach().requires_grad_(), vp.detach().requires_grad_()
    dkp, dvp = grads(attend(q, kl, vl, mp), (kl, vl))
    assert torch.count_nonzero(dkp[..., s_kv:, :]) == 0
    assert torch.count_nonzero(dvp[..., s_kv:, :]) == 0
    assert_close(dkp[..., :s_kv, :], ref_g[1], TOL, what="dk of padded leaf")
    assert_close(dvp[..., :s_kv, :], ref_g[2], TOL, what="dv of padded leaf")
    return kp, vp, mp


@pytest.mark.parametrize("attend", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("mask_kind", MASKS, ids=mask_id)
@pytest.mark.parametrize("s_kv", [1, 7, 130])
def test_padded_attention_is_exact_4d(ow, attend, mask_kind, s_kv):
    kind, rank = mask_kind
    q, k, v = qkv(B, H, L, s_kv, E, requires_grad=True)
    mask = make_mask(kind, B, H, L, s_kv, rank=rank)
    padded_equals_unpadded(ow, attend, q, k, v, mask)


@pytest.mark.parametrize("attend", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("kind", ["none", "bool", "additive", "key", "rank2"])
def test_padded_attention_is_exact_3d_and_keeps_rank(ow, attend, kind):
    N, S = 4, 9
    q = randn(N, L, E, seed=1, requires_grad=True)
    k = randn(N, S, E, seed=2, requires_grad=True)
    v = randn(N, S, 6, seed=3, requires_grad=True)  # value head_dim differs
    mask = {
        "none": None,
        "bool": make_mask("bool", N, 1, L, S)[:, 0],
        "additive": make_mask("additive", N, 1, L, S)[:, 0],
        "key": make_mask("key_bool", N, 1, L, S)[:, 0],  # [N, 1, S]
        "rank2": make_mask("bool", N, 1, L, S, rank=2),
    }[kind]
    kp, vp, mp = padded_equals_unpadded(ow, attend, q, k, v, mask)
    assert kp.dim() == 3 and vp.dim() == 3
    assert kp.shape == (N, 128, E) and vp.shape == (N, 128, 6)
    if mask is not None:
        assert mp.dim() == mask.dim()
        assert mp.shape[:-1] == mask.shape[:-1]


def test_fully_masked_rows_stay_fully_masked(ow):
    q, k, v = qkv(B, H, L, 9, E, requires_grad=True)
    for kind in ("bool", "additive"):
        mask = make_mask(kind, B, H, L, 9, empty_rows=(0, 3))
        kp, vp, mp = padded_equals_unpadded(ow, reference_attention, q, k, v, mask)
        out = reference_attention(q, kp, vp, mp)
        assert torch.count_nonzero(out[..., [0, 3], :]) == 0


# --------------------------------------------------------------------------
# What the padded tensors look like
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_padded_tail_is_zero_and_hidden(ow, kind):
    S = 10
    k = randn(B, H, S, E, seed=1)
    v = randn(B, H, S, 4, seed=2)
    mask = make_mask(kind, B, H, L, S)
    kp, vp, mp = ow.pad_keys(k, v, mask)
    assert kp.shape == (B, H, 128, E) and vp.shape == (B, H, 128, 4)
    assert torch.equal(kp[..., :S, :], k) and torch.equal(vp[..., :S, :], v)
    assert torch.count_nonzero(kp[..., S:, :]) == 0
    assert torch.count_nonzero(vp[..., S:, :]) == 0
    assert mp.dtype == mask.dtype and mp.shape == (B, H, L, 128)
    assert torch.equal(mp[..., :S], mask)
    if kind == "bool":
        assert not mp[..., S:].any()
    else:
        assert torch.all(mp[..., S:] == float("-inf"))


def test_no_mask_gives_a_key_padding_mask(ow):
    S = 5
    k, v = randn(B, H, S, E), randn(B, H, S, E, seed=1)
    _, _, mp = ow.pad_keys(k, v)
    assert mp.dtype == torch.bool and mp.shape == (1, 128)
    assert mp[0, :S].all() and not mp[0, S:].any()


def test_additive_mask_keeps_its_dtype(ow):
    k, v = randn(B, H, 6, E), randn(B, H, 6, E, seed=1)
    mask = make_mask("additive", B, H, L, 6, dtype=torch.float32)
    _, _, mp = ow.pad_keys(k, v, mask)
    assert mp.dtype == torch.float32
    assert torch.all(mp[..., 6:] == float("-inf"))


def stride_order(t):
    """Dims from outermost to innermost by stride (size-1 dims left out)."""
    dims = [d for d in range(t.dim()) if t.size(d) != 1]
    return sorted(dims, key=lambda d: -t.stride(d))


def test_bshd_view_stays_bshd(ow):
    k = randn(B, H, 9, E, layout="bshd")
    v = randn(B, H, 9, E, seed=1, layout="bshd")
    kp, vp, _ = ow.pad_keys(k, v)
    for orig, padded in ((k, kp), (v, vp)):
        assert stride_order(padded) == stride_order(orig) == [0, 2, 1, 3]
        # A dense buffer in [B, S, H, E] order.
        assert padded.transpose(1, 2).is_contiguous()
        assert torch.equal(padded[..., :9, :], orig)


def test_fused_qkv_slices_pad_to_dense_bshd(ow):
    _, q, k, v = fused_qkv(B, H, 9, E)
    kp, vp, _ = ow.pad_keys(k, v)
    for orig, padded in ((k, kp), (v, vp)):
        assert stride_order(padded) == stride_order(orig)
        assert padded.transpose(1, 2).is_contiguous()
        assert padded.stride(-1) == 1
        assert torch.equal(padded[..., :9, :], orig)


def test_broadcast_heads_stay_broadcast(ow):
    _, k = expanded_heads(B, H, 9, E, seed=1)
    _, v = expanded_heads(B, H, 9, E, seed=2)
    kp, vp, _ = ow.pad_keys(k, v)
    for orig, padded in ((k, kp), (v, vp)):
        assert padded.shape == (B, H, 128, E)
        assert padded.stride(1) == 0
        assert padded.stride(-1) == 1
        assert torch.equal(padded[..., :9, :], orig)
        # Storage holds one head, not H.
        assert padded.untyped_storage().nbytes() == B * 128 * E * padded.element_size()


def test_sequence_broadcast_key_keeps_unit_last_stride(ow):
    """A key broadcast along the sequence axis ([B, H, 1, E] expanded to
    [B, H, S, E]) has unit stride on head_dim; the padded copy must keep it
    (cuDNN needs last-dim stride 1, and "layout kept" is the shim's promise)."""
    base = randn(B, H, 1, E)
    k = base.expand(B, H, 9, E)
    v = randn(B, H, 9, E, seed=1)
    kp, _, _ = ow.pad_keys(k, v)
    assert torch.equal(kp[..., :9, :], k)
    assert kp.stride(-1) == 1, (
        f"padded key strides {kp.stride()} for input strides {k.stride()}")


def test_key_only_mask_is_not_materialised(ow):
    k, v = randn(B, H, 9, E), randn(B, H, 9, E, seed=1)
    for kind in ("key_bool", "key_additive"):
        mask = make_mask(kind, B, H, L, 9)
        _, _, mp = ow.pad_keys(k, v, mask)
        assert mp.shape == (B, 1, 1, 128)
        assert torch.equal(mp[..., :9], mask)


def test_expanded_mask_stays_broadcast(ow):
    k, v = randn(B, H, 9, E), randn(B, H, 9, E, seed=1)
    key_mask = make_mask("key_bool", B, H, L, 9)
    mask = key_mask.expand(B, H, L, 9)
    _, _, mp = ow.pad_keys(k, v, mask)
    assert mp.shape == (B, H, L, 128)
    assert mp.stride(1) == 0 and mp.stride(2) == 0
    assert torch.equal(mp[..., :9], mask) and not mp[..., 9:].any()


def test_key_axis_broadcast_mask_is_materialised_along_keys_only(ow):
    k, v = randn(B, H, 9, E), randn(B, H, 9, E, seed=1)
    mask = make_mask("key_broadcast", B, H, L, 9)  # [B, H, L, 1]
    _, _, mp = ow.pad_keys(k, v, mask)
    assert mp.shape == (B, H, L, 128)
    assert torch.equal(mp[..., :9], mask.expand(B, H, L, 9))
    assert torch.all(mp[..., 9:] == float("-inf"))
    # A [B, 1, 1, 1] mask becomes [B, 1, 1, S_pad], not [B, H, L, S_pad].
    small = torch.zeros(B, 1, 1, 1, dtype=torch.float64)
    _, _, mp = ow.pad_keys(k, v, small)
    assert mp.shape == (B, 1, 1, 128)


@pytest.mark.parametrize("s_kv", [128, 256])
@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_aligned_keys_are_returned_without_copy(ow, s_kv, kind):
    k, v = randn(B, H, s_kv, E), randn(B, H, s_kv, E, seed=1)
    mask = make_mask(kind, B, H, L, s_kv)
    kp, vp, mp = ow.pad_keys(k, v, mask)
    assert kp.data_ptr() == k.data_ptr() and kp.shape == k.shape
    assert vp.data_ptr() == v.data_ptr() and vp.shape == v.shape
    if mask is None:
        assert mp.shape == (1, s_kv) and mp.all()
    else:
        assert mp.data_ptr() == mask.data_ptr() and mp.shape == mask.shape


@pytest.mark.parametrize(
    "s_kv,multiple,expected",
    [(7, 1, 7), (7, 8, 8), (8, 8, 8), (9, 8, 16), (7, 48, 48), (100, 48, 144),
     (129, 128, 256), (3, 100, 100), (0, 128, 0)],
)
def test_other_multiples(ow, s_kv, multiple, expected):
    k = randn(B, H, s_kv, E, requires_grad=True)
    v = randn(B, H, s_kv, E, seed=1, requires_grad=True)
    mask = make_mask("bool", B, H, L, s_kv) if s_kv else None
    kp, vp, mp = ow.pad_keys(k, v, mask, multiple)
    assert kp.shape[-2] == vp.shape[-2] == mp.shape[-1] == expected
    if expected == s_kv:
        assert kp.data_ptr() == k.data_ptr()
    if s_kv:
        q = randn(B, H, L, E, seed=3, requires_grad=True)
        padded_equals_unpadded(ow, reference_attention, q, k, v, mask, multiple)


@pytest.mark.parametrize("multiple", [0, -1, -128])
def test_non_positive_multiple_raises(ow, multiple):
    k, v = randn(B, H, 5, E), randn(B, H, 5, E, seed=1)
    with pytest.raises(RuntimeError, match=rf"openwam::pad_keys: multiple .*got {multiple}"):
        ow.pad_keys(k, v, None, multiple)


@pytest.mark.parametrize("with_mask", ["none", "bool", "additive"])
def test_pad_keys_gradcheck(ow, with_mask):
    k = randn(1, 2, 3, 2, requires_grad=True)
    v = randn(1, 2, 3, 3, seed=1, requires_grad=True)
    if with_mask == "additive":
        m = randn(1, 1, 2, 3, seed=2, requires_grad=True)
        # The -inf tail has no finite difference: check the rest of the mask.
        def fn(k, v, m):
            kp, vp, mp = ow.pad_keys(k, v, m, 4)
            return kp, vp, mp[..., :3]

        inputs = (k, v, m)
    else:
        m = make_mask("bool", 1, 1, 2, 3) if with_mask == "bool" else None
        fn = lambda k, v: ow.pad_keys(k, v, m, 4)[:2]  # noqa: E731
        inputs = (k, v)
    assert torch.autograd.gradcheck(fn, inputs)


# --------------------------------------------------------------------------
# Through the op on CPU: the pad setting concerns the cuDNN path only
# --------------------------------------------------------------------------
# (The plans that pad, carried out by the cuDNN path's leaf ops, are tested on
# the CPU in test_cudnn_path_cpu.py.)


@pytest.mark.parametrize("pad", ["always", "never", "auto"])
def test_cpu_calls_ignore_the_pad_setting(ow, settings, pad):
    settings(pad=pad)
    q, k, v = qkv(B, H, L, 11, E, requires_grad=True)
    mask = make_mask("bool", B, H, L, 11, empty_rows=(1,))
    info = ow.explain(q, k, v, mask)
    assert info["route"] == "pytorch" and info["plan"] == "none"
    assert info["settings"]["pad"] == pad
    out = ow.sdpa(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out, ref)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert torch.equal(a, b)
