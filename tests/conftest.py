"""Shared fixtures and helpers of the CPU suite (tests/test_*.py).

The helpers build inputs (in BHSD or BSHD storage, slices of a fused QKV
buffer, broadcast heads), masks of every kind F.sdpa takes, and an explicit
float64 attention reference with a safe softmax: a query row that sees no key
gets zero output and contributes zero gradient (what F.sdpa does since 2.5 and
what openwam::sdpa promises).

The test modules import the helpers with ``from conftest import ...`` (pytest's
default "prepend" import mode puts tests/ on sys.path). tests/gpu has its own
conftest; nothing here touches a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

ENV_VARS = ("OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD", "OPENWAM_SDPA_CHECK_FINITE")
PAD_MODES = ("auto", "always", "never")
MASK_KINDS = ("none", "bool", "additive", "key_bool", "key_additive")


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    """Every test starts from the default settings, whatever the shell set
    (the op reads them on every call), and from a fixed seed."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)


@pytest.fixture
def settings(monkeypatch):
    """settings(cudnn=None, pad="always", check_finite=None): set the
    openwam_sdpa environment for this test; None unsets a variable."""

    def apply(cudnn=None, pad=None, check_finite=None):
        for name, value in zip(ENV_VARS, (cudnn, pad, check_finite)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))

    return apply


@pytest.fixture(scope="session")
def ow():
    """The package under test (from PYTHONPATH or the installed package)."""
    import openwam_sdpa

    return openwam_sdpa


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float64, seed=0, requires_grad=False, layout="bhsd"):
    """A random tensor of logical shape `shape` ([..., H, S, E] for 4-D).

    layout "bhsd": contiguous. "bshd" (4-D only): a [B, S, H, E] buffer viewed
    as [B, H, S, E], as attention modules produce it.
    """
    g = gen(seed)
    if layout == "bhsd":
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    elif layout == "bshd":
        assert len(shape) == 4
        B, H, S, E = shape
        t = torch.randn(B, S, H, E, generator=g, dtype=torch.float64).to(dtype)
        t = t.transpose(1, 2)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return t.requires_grad_(requires_grad)


def qkv(B, Hq, L, S, E, *, Hkv=None, Ev=None, dtype=torch.float64, seed=0,
        layout="bhsd", requires_grad=False):
    """(q, k, v) leaves of shapes [B,Hq,L,E], [B,Hkv,S,E], [B,Hkv,S,Ev]."""
    Hkv = Hq if Hkv is None else Hkv
    Ev = E if Ev is None else Ev
    q = randn(B, Hq, L, E, dtype=dtype, seed=seed, layout=layout)
    k = randn(B, Hkv, S, E, dtype=dtype, seed=seed + 1, layout=layout)
    v = randn(B, Hkv, S, Ev, dtype=dtype, seed=seed + 2, layout=layout)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def fused_qkv(B, H, S, E, *, dtype=torch.float64, seed=0):
    """q, k, v as slices of one [B, S, 3, H, E] buffer (a fused QKV
    projection), viewed as [B, H, S, E]; the buffer is the autograd leaf."""
    buf = randn(B, S, 3, H * E, dtype=dtype, seed=seed).view(B, S, 3, H, E)
    buf = buf.detach().requires_grad_()
    q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
    return buf, q, k, v


def expanded_heads(B, H, S, E, *, dtype=torch.float64, seed=0):
    """A [B, 1, S, E] leaf expanded (stride 0) to [B, H, S, E]."""
    base = randn(B, 1, S, E, dtype=dtype, seed=seed).detach().requires_grad_()
    return base, base.expand(B, H, S, E)


def make_mask(kind, B, H, L, S, *, dtype=torch.float64, seed=7, keep=0.7,
              empty_rows=(), rank=4):
    """A mask as F.sdpa takes it, or None.

    kind: "none"; "bool" (True = attend) or "additive" (random bias, -inf where
    hidden) of shape [B, H, L, S] (rank 4) or [L, S] (rank 2); "key_bool" /
    "key_additive": key-padding masks [B, 1, 1, S]; "key_broadcast": an
    additive [B, H, L, 1] mask (broadcast along the key axis).
    Every query row keeps at least one visible key, except `empty_rows`
    (query rows that see no key at all; not for key_* / key_broadcast).
    """
    if kind == "none":
        return None
    g = gen(seed)
    if kind == "key_broadcast":
        return torch.randn(B, H, L, 1, generator=g, dtype=torch.float64).to(dtype)
    if kind in ("key_bool", "key_additive"):
        shape, base = (B, 1, 1, S), kind[4:]
    elif rank == 4:
        shape, base = (B, H, L, S), kind
    elif rank == 2:
        shape, base = (L, S), kind
    else:
        raise ValueError(f"unsupported mask rank {rank}")
    visible = torch.rand(shape, generator=g) < keep
    if S > 0 and visible.numel() > 0:
        anchor = torch.randint(0, S, shape[:-1] + (1,), generator=g)
        visible.scatter_(-1, anchor, True)
    for r in empty_rows:
        visible[..., r, :] = False
    if base == "bool":
        return visible
    if base == "additive":
        bias = 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
        return bias.masked_fill(~visible, float("-inf")).to(dtype)
    raise ValueError(f"unknown mask kind {kind!r}")


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------


def reference_attention_lse(q, k, v, attn_mask=None, is_causal=False,
                            scale=None, enable_gqa=False):
    """(output, row logsumexp) of attention in float64 from the given
    (differentiable) tensors, on their device, with a safe softmax: a row that
    sees no key has output 0, gradient 0 and logsumexp -inf.
    is_causal is top-left aligned like F.sdpa's (row i sees keys 0..i)."""
    q, k, v = (t.double() for t in (q, k, v))
    E = q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    logits = (q @ k.transpose(-1, -2)) * scale
    L, S = logits.shape[-2:]
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.double()
    row_max = logits.amax(-1, keepdim=True).detach() if S > 0 else logits.new_zeros(
        logits.shape[:-1] + (1,))
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(logits - row_max)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (row_max + torch.log(denom)).squeeze(-1).detach()
    return p @ v, lse


def reference_attention(q, k, v, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False):
    """The output of reference_attention_lse (differentiable)."""
    return reference_attention_lse(q, k, v, attn_mask, is_causal, scale, enable_gqa)[0]


def grads(out, inputs, grad_out=None, seed=11, retain_graph=False):
    """d(out . grad_out)/d(inputs), grad_out random (seeded) unless given."""
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=gen(seed), dtype=torch.float64)
    grad_out = grad_out.to(out.dtype)
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True,
                               retain_graph=retain_graph)


def fwd_bwd(fn, inputs, *args, grad_out=None, **kwargs):
    """(out, grads of inputs) of fn(*inputs, *args, **kwargs)."""
    out = fn(*inputs, *args, **kwargs)
    return out.detach(), grads(out, inputs, grad_out)


def assert_close(actual, expected, atol, rtol=0.0, what=""):
    """Like torch.testing.assert_close with NaN == NaN and a message."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def sdpa_error_vs(ref64, x):
    """Max absolute error of x against a float64 reference."""
    return (x.double() - ref64).abs().max().item() if x.numel() else 0.0


F_SDPA = F.scaled_dot_product_attention  # bound before any test can patch it
