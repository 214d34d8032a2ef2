"""The helpers of both test suites (tests/ on the CPU, tests/gpu on CUDA).

* inputs: random tensors in BHSD or BSHD storage, slices of a fused QKV
  buffer, broadcast heads, and adversarial q/k/v (through the package's own
  builder, openwam_sdpa.adversarial), on any device;
* masks of every kind F.sdpa takes (make_mask, one meaning for every kind);
* the float64 reference with a safe softmax: a query row that sees no key
  gets zero output and contributes zero gradient (what F.sdpa does since 2.5
  and what openwam::sdpa promises);
* the error rule: at most twice stock PyTorch's own error, plus one floor;
* the repository's tools and benchmarks (tools/*.py, benchmarks/*.py) as
  modules, for their CPU tests.

Random data is drawn in float64 on the CPU from a seeded generator and then
moved, so every device gets the same numbers. Nothing here touches a GPU
unless asked to, and nothing imports openwam_sdpa at import time.

The test modules import it as ``from support import ...`` (pytest's default
"prepend" import mode puts tests/ on sys.path); fixtures live in conftest.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

ENV_VARS = ("OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD", "OPENWAM_SDPA_CHECK_FINITE",
            "OPENWAM_SDPA_FRONTEND")
F_SDPA = F.scaled_dot_product_attention  # bound before any test can patch it


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float64, seed=0, generator=None, layout="bhsd", device="cpu",
          requires_grad=False):
    """A random tensor of logical shape `shape` ([..., H, S, E] for 4-D),
    drawn from `generator`, or from a fresh one seeded with `seed`.

    layout "bhsd": contiguous. "bshd" (4-D only): a [B, S, H, E] buffer viewed
    as [B, H, S, E], as attention modules produce it.
    """
    g = gen(seed) if generator is None else generator
    if layout == "bhsd":
        t = torch.randn(shape, generator=g, dtype=torch.float64)
    elif layout == "bshd":
        assert len(shape) == 4
        B, H, S, E = shape
        t = torch.randn(B, S, H, E, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def qkv(B, Hq, L, S, E, *, Hkv=None, Ev=None, dtype=torch.float64, seed=0, layout="bhsd",
        device="cpu", requires_grad=False):
    """(q, k, v) leaves of shapes [B,Hq,L,E], [B,Hkv,S,E], [B,Hkv,S,Ev], drawn
    in turn from one generator seeded with `seed`."""
    Hkv = Hq if Hkv is None else Hkv
    Ev = E if Ev is None else Ev
    g = gen(seed)
    common = dict(dtype=dtype, generator=g, layout=layout, device=device,
                  requires_grad=requires_grad)
    return (randn(B, Hq, L, E, **common), randn(B, Hkv, S, E, **common),
            randn(B, Hkv, S, Ev, **common))


def fused_qkv(B, H, S, E, *, dtype=torch.float64, seed=0, device="cpu"):
    """q, k, v as slices of one [B, S, 3, H, E] buffer (a fused QKV
    projection), viewed as [B, H, S, E]; the buffer is the autograd leaf."""
    buf = randn(B, S, 3, H * E, dtype=dtype, seed=seed, device=device).view(B, S, 3, H, E)
    buf = buf.detach().requires_grad_()
    q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
    return buf, q, k, v


def expanded_heads(B, H, S, E, *, dtype=torch.float64, seed=0, device="cpu"):
    """A [B, 1, S, E] leaf expanded (stride 0) to [B, H, S, E]."""
    base = randn(B, 1, S, E, dtype=dtype, seed=seed, device=device, requires_grad=True)
    return base, base.expand(B, H, S, E)


def adversarial_qkv(B, H, s_q, s_kv, D, low_rows, *, Hkv=None, target=None, scale=None,
                    layout="bhsd", dtype=torch.bfloat16, device="cpu", seed=0,
                    requires_grad=True):
    """(q, k, v) leaves from openwam_sdpa.adversarial.adversarial_inputs: the
    query rows `low_rows` of every batch and head have every logit near
    `target` (the builder's default unless given), so their logsumexp lies far
    below -88.7 (= -ln FLT_MAX); the other rows are standard normal."""
    from openwam_sdpa.adversarial import DEFAULT_TARGET, adversarial_inputs

    rows = torch.zeros(s_q, dtype=torch.bool)
    rows[list(low_rows)] = True
    a = adversarial_inputs(B, H, s_q, s_kv, D, rows=rows,
                           target=DEFAULT_TARGET if target is None else target,
                           kv_heads=Hkv, scale=scale, layout=layout, dtype=dtype,
                           device=device, seed=seed, requires_grad=requires_grad)
    return a.query, a.key, a.value


# --------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------

# Every kind make_mask builds, and the dense ones (a full query x key mask,
# or none) that the GPU suite sweeps.
MASK_KINDS = ("none", "bool", "additive", "key_bool", "key_additive", "key_broadcast")
DENSE_MASK_KINDS = ("none", "bool", "additive")


def make_mask(kind, B, H, L, S, *, rank=4, dtype=torch.float64, device="cpu", seed=7, keep=0.7,
              empty_rows=()):
    """A mask as F.sdpa takes it, or None.

    kind: "none" (None); "bool" (True = attend) or "additive" (0.5 * N(0, 1)
    where visible, -inf where hidden, in `dtype`) of shape [B, H, L, S]
    (rank 4) or [L, S] (rank 2); "key_bool" / "key_additive": key-padding
    masks [B, 1, 1, S]; "key_broadcast": an additive [B, H, L, 1] mask
    (random, broadcast along the key axis). Each key is visible with
    probability `keep`, and every query row keeps at least one visible key
    (at a random position), except `empty_rows`: query rows that see no key
    at all (not for the key_* kinds).
    """
    if kind == "none":
        return None
    g = gen(seed)
    if kind == "key_broadcast":
        mask = torch.randn(B, H, L, 1, generator=g, dtype=torch.float64)
        return mask.to(device=device, dtype=dtype)
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
        return visible.to(device)
    if base == "additive":
        bias = 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
        return bias.masked_fill(~visible, float("-inf")).to(device=device, dtype=dtype)
    raise ValueError(f"unknown mask kind {kind!r}")


# --------------------------------------------------------------------------
# The float64 reference
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
    grad_out = grad_out.to(device=out.device, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True,
                               retain_graph=retain_graph)


class Attn(NamedTuple):
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def run(fn, q, k, v, go, **kwargs) -> Attn:
    """Forward through `fn` (F.sdpa's signature), then dQ, dK, dV for `go`."""
    out = fn(q, k, v, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return Attn(out.detach(), dq, dk, dv)


def run_by_backward(fn, q, k, v, go, **kwargs) -> Attn:
    """As run(), through .backward() on fresh leaves: reentrant activation
    checkpointing refuses torch.autograd.grad."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    out.backward(go)
    return Attn(out.detach(), *(t.grad for t in leaves))


def assert_same_draw(ckpt: Attn, plain: Attn):
    """The checkpointed call drew the uncheckpointed call's dropout pattern:
    the same output, bit for bit, and the same gradients up to cuDNN's atomic
    dQ accumulation (another pattern moves them by their own size)."""
    assert torch.equal(ckpt.out, plain.out), "another dropout pattern in the output"
    for name in ("dq", "dk", "dv"):
        a, b = getattr(ckpt, name).float(), getattr(plain, name).float()
        assert (a - b).abs().max() <= 1e-2 * b.abs().max(), name


def reference(q, k, v, go, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """(Attn, row logsumexp): attention and its gradients for `go`, in
    float64 from the values of q, k, v (half-precision ones included, so that
    an error against it is the kernel's own, not the inputs' rounding), by
    reference_attention_lse and autograd. The logsumexp is -inf for a row
    that sees no key."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention_lse(q64, k64, v64, attn_mask, is_causal, scale, enable_gqa)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), go.double())
    return Attn(out.detach(), dq, dk, dv), lse


def assert_close(actual, expected, atol, rtol=0.0, what=""):
    """Like torch.testing.assert_close with NaN == NaN and a message."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


def traced_graphs(fn, *args, grad_out=None) -> dict:
    """{"forward": GraphModule, "backward": GraphModule}: what AOTAutograd
    traces for fn(*args) and its backward (for `grad_out`, or of the sum of
    the output)."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    out = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(*args)
    if grad_out is None:
        out.float().sum().backward()
    else:
        out.backward(grad_out)
    return graphs


def call_targets(gm) -> list[str]:
    """The targets of a graph's call_function nodes, as strings."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


# --------------------------------------------------------------------------
# Metrics and the error rule
# --------------------------------------------------------------------------


def nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def nonfinite_grads(r: Attn) -> int:
    return nonfinite(r.dq) + nonfinite(r.dk) + nonfinite(r.dv)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference (inf or NaN if x has a non-finite
    element); 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    return float((x.detach().double() - ref.detach()).abs().max())


DROPOUT_DRAWS = 16


def dropout_bias(forward, ref_out: torch.Tensor, draws: int = DROPOUT_DRAWS) -> float:
    """How far the mean of out - ref lies from 0, in standard errors, over
    `draws` calls of forward() with fresh dropout: each draw's mean error is
    one sample. (The elements of one draw are not independent samples: a row's
    outputs share its dropout draws over the keys, so one draw's own spread
    understates the noise of its mean; with 3 keys, 8 rows and head_dim 64
    that made 1 in 200 unbiased draws look 6 standard errors off.) Grad
    stays enabled: a differentiated call's forward is the one under test (the
    op may plan a call nothing differentiates differently). inf for a
    constant nonzero offset, NaN for a non-finite output, 0 for an empty one
    (no query: nothing drawn)."""
    if ref_out.numel() == 0:
        return 0.0
    means = torch.stack([(forward().detach().double() - ref_out.double()).mean()
                         for _ in range(draws)])
    mean, se = float(means.mean()), float(means.std()) / math.sqrt(draws)
    if se == 0.0:
        return 0.0 if mean == 0.0 else math.inf
    return abs(mean) / se


def ulp_at_max(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """eps(dtype) * max|ref|: the spacing of `dtype` near the tensor's
    largest entry (up to a factor 2); 0 for an empty tensor."""
    if ref.numel() == 0:
        return 0.0
    return torch.finfo(dtype).eps * float(ref.abs().max())


def floor_for(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The floor of the error rule, the only one for max-norm errors: a
    quarter of ulp_at_max (bf16: 2^-9 * max|ref|; fp16: 2^-12 * max|ref|).
    It only matters where stock's own error is about 0 (a kernel that
    happens to round like the reference); real defects are O(1) or NaN."""
    return ulp_at_max(ref, dtype) / 4


def replayed_cases(env_var: str, cases: int) -> tuple[set, int]:
    """A fuzz's replay: the case numbers listed in `env_var` (comma-separated;
    empty: every case) and how many cases to draw so that each listed one is
    drawn, past `cases` too."""
    only = {int(x) for x in os.environ.get(env_var, "").split(",") if x.strip()}
    return only, max(cases, max(only, default=-1) + 1)


def zero_gradient_floor(name, q, k, v, go, scale=None) -> float:
    """The floor of a gradient whose exact value is 0: dQ and dK (`name`
    "dq" or "dk") where every query sees key 0 alone (one key, or one query
    under is_causal): softmax 1, so dP - delta cancels exactly. The kernels
    compute dP = dO . V and delta = dO . O as fp32 dot products, each
    rounding within eps times the sum of its terms' magnitudes,
    t_i = sum_d |dO_id V_0d|; the difference is scaled by `scale` and the
    other operand: K_0 for dQ_i; for dK_0, the sum over every query and
    query head of its group of t_i |Q_i|. The floor is four fp32 ulps at
    scale * max_i t_i * max|K_0| (dQ) or scale * max over key heads of
    sum_i t_i max|Q_i| (dK). PyTorch's fused CPU kernel stays within one
    (test_fuzz_rules.py), and a delta 1% off lies 100 times above it. Where
    the tensor's relative error is undefined and its own largest entry is 0,
    that is what a correct kernel can give. q and go are (s_q, heads,
    head_dim), k and v (s_k, kv_heads, head_dim); keys past the first are
    seen by no query and left out."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    q, go = q.detach().double(), go.detach().double()
    k, v = k[:1].detach().double(), v[:1].detach().double()
    kv_heads, rep = k.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # t[h, i] = sum_d |dO_{i,h,d} V_{0,h/rep,d}|
    t = torch.einsum("qhd,hd->hq", go.abs(), v[0].abs().repeat_interleave(rep, 0))
    if name == "dq":
        size = scale * float(t.max()) * float(k.abs().max())
    else:
        per_head = t * q.abs().amax(-1).transpose(0, 1)  # [heads, s_q]
        size = scale * float(per_head.reshape(kv_heads, -1).sum(-1).max())
    return 4 * ulp_at_max(torch.tensor(size), torch.float32)


def tensor_core_attention(q, k, v, go, dtype, is_causal=False, scale=None) -> Attn:
    """Attention on one sequence by a kernel that rounds only what a
    tensor-core kernel must: exact arithmetic, except that the probabilities
    P and the score gradients dS are rounded to `dtype` before the products
    that take them (O = P V, dV = P^T dO, dQ = dS K, dK = dS^T Q), the
    backward reads the output in `dtype` (delta = dO . O), and each result is
    rounded to `dtype`. FlashAttention-2, efficient attention and cuDNN all
    feed their tensor cores so. Its error against the exact result is the
    floor of a rule that compares kernels on one sequence: where the keys
    share a large component (the adversarial rows' keys) the products' terms
    cancel, and the rounding of dS leaves errors far above an ulp of dQ, by
    an amount each kernel draws differently. out, dQ, dK, dV in float64; q
    and go are (s_q, heads, head_dim), k and v (s_k, kv_heads, head_dim), and
    the results take the same layouts; is_causal aligns top-left, as F.sdpa."""
    kv_heads, rep = k.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads_first = lambda t: t.detach().double().transpose(0, 1)  # noqa: E731
    q, go = heads_first(q), heads_first(go)
    k, v = (heads_first(t).repeat_interleave(rep, 0) for t in (k, v))
    s = scale * q @ k.transpose(-1, -2)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool,
                                     device=s.device).triu(1), -math.inf)
    p = torch.softmax(s, -1)  # top-left causal: every query sees key 0
    rounded = lambda t: t.to(dtype).double()  # noqa: E731
    out = rounded(rounded(p) @ v)
    ds = p * (go @ v.transpose(-1, -2) - (go * out).sum(-1, keepdim=True))

    def packed(t, by_key_head=False):  # a key head's gradient sums its query heads'
        if by_key_head:
            t = t.reshape(kv_heads, rep, *t.shape[1:]).sum(1)
        return rounded(t).transpose(0, 1)

    return Attn(packed(out), packed(scale * rounded(ds) @ k),
                packed(scale * rounded(ds).transpose(-1, -2) @ q, True),
                packed(rounded(p).transpose(-1, -2) @ go, True))


STOCK_FACTOR = 2.0


def twice_stock_problem(name, err, stock_err, floor) -> str | None:
    """flash-attention's rule, the one comparison every suite makes:
    err <= STOCK_FACTOR * stock_err + floor. A message when violated (NaN
    included), else None. The errors are whatever the caller measures;
    rule_violation measures max-norm errors of one tensor with floor_for."""
    bound = STOCK_FACTOR * stock_err + floor
    if not err <= bound:
        return (f"{name}: error {err:.3e} > {STOCK_FACTOR:g} x stock {stock_err:.3e} "
                f"+ floor {floor:.3e} = {bound:.3e}")
    return None


def contract_clause(err, floor, *, best, as_called, flash_efficient,
                    key_padded=lambda: math.inf) -> str | None:
    """The dense fuzz's rule on one tensor: which clause admits the op's max
    error `err` (None: none does). best: the best finite stock backend's
    error; as_called: stock F.sdpa's as the user calls it (inf or NaN where
    it is not finite); flash_efficient: the worse of flash and efficient
    attention's, the yardstick where stock as called is not finite;
    key_padded: a callable giving stock cuDNN's error on the same attention
    with the keys padded to a multiple of 128 (inf where that cannot run),
    the clause beyond the contract for cuDNN's own arithmetic, called only
    where stock as called is not finite and no other clause admits."""
    if math.isfinite(best) and err <= STOCK_FACTOR * best + floor:
        return "best stock"
    if math.isfinite(as_called):  # inf: stock as called refused the call, or NaN
        return "as called" if err <= STOCK_FACTOR * as_called + floor else None
    if err <= flash_efficient:
        return "flash or efficient"
    return "key-padded cuDNN" if within_key_padded(err, key_padded(), floor) else None


def within_key_padded(err, key_padded, floor) -> bool:
    """Both fuzzes' last clause, beyond the contract: `err` within twice
    stock cuDNN's error on the same attention with the keys zero-padded to a
    multiple of 128 (its own arithmetic without the key-tail defect), plus
    `floor`. A key-padded run that could not run (inf) or was not finite
    (NaN) admits nothing."""
    return math.isfinite(key_padded) and err <= STOCK_FACTOR * key_padded + floor


def packed_yardstick(as_called, varlen, flash, efficient) -> float:
    """The varlen fuzz's yardstick on one sequence's tensor: the op passes
    within twice any of stock F.sdpa as called on the sequence alone, stock
    varlen (FlashAttention-2's) on the pack, and, where stock as called is not
    finite, the worse of flash and efficient attention; so the largest finite
    of those (inf where none is)."""
    candidates = [as_called, varlen] + ([flash, efficient] if not math.isfinite(as_called)
                                        else [])
    return max((e for e in candidates if math.isfinite(e)), default=math.inf)


def rule_violation(name, ours, stock, ref, dtype) -> str | None:
    """The error rule on one output or gradient in `dtype`: max|ours - ref|
    at most twice max|stock - ref|, plus floor_for(ref, dtype)."""
    return twice_stock_problem(name, max_err(ours, ref), max_err(stock, ref),
                               floor_for(ref, dtype))


def assert_within_stock(ours: Attn, stock: Attn, ref: Attn, dtype, names="out dq dk dv"):
    problems = [rule_violation(n, getattr(ours, n), getattr(stock, n), getattr(ref, n), dtype)
                for n in names.split()]
    problems = [p for p in problems if p]
    assert not problems, "; ".join(problems)


def reference_problem(name, x, ref, dtype, ulps=4.0) -> str | None:
    """For checks without a stock baseline: max|x - ref| <= ulps *
    ulp_at_max(ref, dtype) (+ 1e-12, for a reference of zeros). Stock bf16/fp16
    kernels measure well under 2 ulps on random data; a wrong mask, scale or
    layout gives errors of order max|ref|. A message when not, else None."""
    err = max_err(x, ref)
    bound = ulps * ulp_at_max(ref, dtype) + 1e-12
    if not err <= bound:
        return f"{name}: error {err:.3e} > {bound:.3e} ({ulps:g} eps x max|ref|)"
    return None


def assert_close_to_reference(name, x, ref, dtype, ulps=4.0):
    problem = reference_problem(name, x, ref, dtype, ulps)
    assert problem is None, problem


# --------------------------------------------------------------------------
# Tools and benchmarks
# --------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TOOLS = os.path.join(ROOT, "tools")
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def tool_path(name: str) -> str:
    return os.path.join(TOOLS, name)


def _load_from(folder: str, name: str) -> ModuleType:
    """folder/<name> imported as a module (its main() not run), folder on sys.path for the
    modules it imports from beside it, as when it is run."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name.rsplit(".", 1)[0],
                                                  os.path.join(folder, name))
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would be: a dataclass under
    # `from __future__ import annotations` looks its module up there.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_tool(name: str) -> ModuleType:
    """tools/<name> imported as a module (see _load_from)."""
    return _load_from(TOOLS, name)


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name> imported as a module (see _load_from)."""
    return _load_from(BENCHMARKS, name)


def spawn_gloo_workers(worker, args, nprocs, result_files, timeout_s):
    """Runs worker(rank, *args) in `nprocs` spawned processes and waits for them.

    A worker that raises, or dies before every path in `result_files` exists,
    fails the caller. A worker killed by a signal after all of them exist is
    the gloo teardown abort ("terminate called without an active exception":
    a rank that destroys its process group while the other's last sends are
    in flight), which happens in PyTorch's gloo code after the work is done
    and checked; it is not a failure of the work."""
    import time

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gloo workers did not finish in {timeout_s} s")
    except ProcessExitedException as e:
        if e.signal_name is None or not all(os.path.exists(p) for p in result_files):
            raise
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
