"""F.sdpa's features through openwam_sdpa on the GPU: dropout, is_causal with
unequal lengths, scale, GQA, fp16/bf16, fully masked rows, the fp32
fallback, and the OPENWAM_SDPA_CHECK_FINITE debug switch.

Unless a test says otherwise: OPENWAM_SDPA_CUDNN=1 (the cuDNN path, where the
defect lives), B=2, H=4, bf16, head_dim 128, and results compared with a
float64 reference under the "twice stock's own error" rule.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from support import (
    assert_close_to_reference,
    assert_same_draw,
    assert_within_stock,
    nonfinite,
    nonfinite_grads,
    reference,
    run,
    run_by_backward,
)

from .conftest import (
    GPU_MARKS,
    KEY_TILE,
    cuda_adversarial_qkv,
    cuda_mask,
    cuda_qkv,
    cuda_randn,
    cudnn_version,
    low_row_problem,
    stock_baseline,
    stock_cudnn,
    stock_defect_measured,
)

pytestmark = GPU_MARKS

B, H, D = 2, 4, 128
BF16 = torch.bfloat16


def _inputs(data, s_q, s_kv, *, low_rows=(9,), seed=0, **kwargs):
    if data == "adversarial":
        return cuda_adversarial_qkv(B, kwargs.pop("H", H), s_q, s_kv, kwargs.pop("D", D),
                                    low_rows, seed=seed, **kwargs)
    return cuda_qkv(B, kwargs.pop("H", H), s_q, s_kv, kwargs.pop("D", D), seed=seed, **kwargs)


def _check_against_reference(ours, q, k, v, go, dtype=BF16, low_rows=(), **kwargs):
    """Finite; within twice stock's error, the adversarial rows of dQ
    included (low_row_problem)."""
    assert nonfinite(ours.out) + nonfinite_grads(ours) == 0, "non-finite output or gradient"
    ref, _ = reference(q, k, v, go, **kwargs)
    baseline, _ = stock_baseline(q, k, v, go, **kwargs)
    assert baseline is not None, "no stock backend serves these inputs"
    assert_within_stock(ours, baseline, ref, dtype)
    if low_rows:
        problem = low_row_problem(ours.dq, ref.dq, low_rows, baseline.dq)
        assert problem is None, problem


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("p,backend", [(0.0625, "cudnn"), (0.1, "pytorch")])
def test_dropout_statistics(p, backend, ow, settings):
    """cuDNN takes dropout in multiples of 1/16; 0.1 goes to PyTorch.
    With q = 0 every key gets weight 1/s_kv and v = 1, so each output row is
    (kept keys) / (s_kv (1 - p)): mean 1, standard deviation
    sqrt(p / ((1 - p) s_kv)) (about 0.01 here). A missing 1/(1-p) rescale
    shifts the mean by p; no dropout at all gives zero spread."""
    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 704
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.zeros(B, H, s_q, D, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(B, H, s_kv, D, device="cuda", generator=g).to(BF16).requires_grad_()
    v = torch.ones(B, H, s_kv, D, device="cuda", dtype=BF16, requires_grad=True)
    assert ow.explain(q, k, v, dropout_p=p)["backend"] == backend

    out = ow.sdpa(q, k, v, dropout_p=p)
    assert out.shape == (B, H, s_q, D)
    assert nonfinite(out) == 0
    rows = out.detach()[..., 0].float()  # every column of a row is the same sum
    sigma = math.sqrt(p / ((1 - p) * s_kv))
    # Mean of 2048 rows: standard error sigma / 45 = 2e-4; bf16 rounding of
    # values near 1 is unbiased over this spread. 0.01 is 40 standard errors
    # and still a sixth of the rescale error p.
    assert abs(float(rows.mean()) - 1.0) < 0.01, f"mean {float(rows.mean()):.4f}"
    spread = float(rows.std())
    assert 0.5 * sigma < spread < 2 * sigma, f"row spread {spread:.4f}, expected {sigma:.4f}"

    go = cuda_randn(*out.shape, seed=4)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert nonfinite(dq) + nonfinite(dk) + nonfinite(dv) == 0


def _outcome(fn, *args, **kwargs):
    """The output's shape and finiteness with its gradients', or the error."""
    try:
        out = fn(*args, **kwargs)
        grads = torch.autograd.grad(out, args[:3], torch.ones_like(out))
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception
        return type(e).__name__, str(e).split("\n")[0]
    return tuple(out.shape), nonfinite(out) + sum(nonfinite(g) for g in grads)


def test_cudnn_the_one_backend_left_keeps_stocks_call(ow, settings):
    """sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION]) with an additive mask
    (flash refuses masks) and inputs the guarded path refuses but stock
    cuDNN may take (dropout 0.1; one key): where PyTorch picks cuDNN, the op
    hands the call over untouched, and its outcome is F.sdpa's. Switching
    cuDNN off for it raised "No available kernel" where F.sdpa ran (found in
    review). Where no backend takes a call (stock cuDNN refuses one key on
    9.19.0), both raise PyTorch's error. At least one of the calls must pose
    the case on this stack (dropout 0.1 did on torch 2.11.0, cuDNN 9.19.0)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    settings(cudnn="1", pad="auto")
    posed = []
    for s_kv, dropout_p in ((320, 0.1), (1, 0.0)):
        q, k, v = cuda_qkv(B, H, 128, s_kv, 64, seed=5)
        mask = torch.zeros(128, s_kv, device="cuda", dtype=BF16)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            stock = _outcome(torch.nn.functional.scaled_dot_product_attention, q, k, v, mask,
                             dropout_p=dropout_p)
            ours = _outcome(ow.sdpa, q, k, v, mask, dropout_p=dropout_p)
            # explain() asks PyTorch's selector, which raises where F.sdpa does.
            info = ow.explain(q, k, v, mask, dropout_p=dropout_p) \
                if isinstance(stock[0], tuple) else None
        assert ours == stock, (s_kv, dropout_p, info)
        if info is not None and info["pytorch_choice"] == "cudnn_attention":
            assert info["route"] == "pytorch", info  # cuDNN not switched off
            assert stock[1] == 0, stock  # ran, finite (random data)
            posed.append((s_kv, dropout_p))
    assert posed, "stock cuDNN took none of the calls under this restriction"


@pytest.mark.parametrize("p", [0.0625, 0.1])
def test_dropout_on_adversarial_inputs_has_finite_gradients(p, ow, settings, suite_results):
    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 704
    q, k, v = cuda_adversarial_qkv(B, H, s_q, s_kv, D, (9, 255), seed=7)
    mask = cuda_mask("bool", B, 1, s_q, s_kv, seed=8)
    go = cuda_randn(*q.shape, seed=9)
    info = ow.explain(q, k, v, attn_mask=mask, dropout_p=p)
    if info["backend"] == "cudnn" and stock_defect_measured(s_kv, D):
        assert info["plan"] == "shift_scores", info
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask, dropout_p=p)
    stock = stock_cudnn(q, k, v, go, attn_mask=mask, dropout_p=p)
    suite_results.put(
        "dropout_adversarial", f"{s_q}x{s_kv}-p{p}",
        backend=info["backend"], plan=info["plan"],
        stock_cudnn_nonfinite=None if stock is None else nonfinite_grads(stock),
        openwam_nonfinite=nonfinite(ours.out) + nonfinite_grads(ours),
    )
    assert nonfinite(ours.out) + nonfinite_grads(ours) == 0


# ---------------------------------------------------------------- causal, scale


CAUSAL_SHAPES = [(128, 320), (200, 704), (320, 192), (392, 200)]


@pytest.mark.parametrize("data", ["random", "adversarial"])
@pytest.mark.parametrize("pad", ["auto", "always"])
@pytest.mark.parametrize("s_q,s_kv", CAUSAL_SHAPES, ids=[f"{a}x{b}" for a, b in CAUSAL_SHAPES])
def test_causal_with_unequal_lengths(s_q, s_kv, pad, data, ow, settings):
    """is_causal is top-left aligned (row i sees keys 0..i). With s_q > s_kv
    the last rows see every key, and with PAD=always the padded keys must
    stay hidden from them although the causal diagonal would reach them."""
    settings(cudnn="1", pad=pad)
    q, k, v = _inputs(data, s_q, s_kv, low_rows=(9,), seed=s_q + s_kv)
    go = cuda_randn(*q.shape, seed=3)
    ours = run(ow.sdpa, q, k, v, go, is_causal=True)
    _check_against_reference(ours, q, k, v, go, is_causal=True,
                             low_rows=(9,) if data == "adversarial" else ())


@pytest.mark.parametrize("data", ["random", "adversarial"])
@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_explicit_scale(scale, data, ow, settings):
    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 704
    kwargs = {"scale": scale} if data == "adversarial" else {}
    q, k, v = _inputs(data, s_q, s_kv, seed=21, **kwargs)
    mask = cuda_mask("additive", B, 1, s_q, s_kv, seed=22)
    go = cuda_randn(*q.shape, seed=23)
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask, scale=scale)
    _check_against_reference(ours, q, k, v, go, attn_mask=mask, scale=scale,
                             low_rows=(9,) if data == "adversarial" else ())


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_activation_checkpointing(mask_kind, use_reentrant, ow, settings):
    """torch.utils.checkpoint recomputes the forward in the backward
    (non-reentrant: at the first unpack of a saved tensor, inside the op's
    backward node). Adversarial rows and a key tail of 64 (the fix's plan)."""
    from torch.utils.checkpoint import checkpoint

    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 320
    q, k, v = _inputs("adversarial", s_q, s_kv, seed=41)
    mask = cuda_mask(mask_kind, B, 1, s_q, s_kv, seed=42)
    go = cuda_randn(*q.shape, seed=43)

    def attention(q, k, v):
        return ow.sdpa(q, k, v, attn_mask=mask)

    ours = run_by_backward(
        lambda *xs: checkpoint(attention, *xs, use_reentrant=use_reentrant), q, k, v, go)
    _check_against_reference(ours, q, k, v, go, attn_mask=mask, low_rows=(9,))


@pytest.mark.parametrize("frontend", ["1", "0"], ids=["frontend", "aten_fallback"])
def test_reentrant_checkpointing_with_dropout_draws_the_same_pattern(frontend, ow, settings):
    """Reentrant checkpointing runs the forward under no_grad and recomputes
    it with grad from the same RNG state. The op takes the plan and the
    training forward for a call with dropout whatever the grad mode, so both
    draw the same pattern. s_kv 320 with a bool mask: on the ATen fallback
    (OPENWAM_SDPA_FRONTEND=0) that plan pads the keys in the forward."""
    from torch.utils.checkpoint import checkpoint

    settings(cudnn="1", pad="auto", frontend=frontend)
    s_q, s_kv = 256, 320
    q, k, v = _inputs("random", s_q, s_kv, seed=44)
    mask = cuda_mask("bool", B, 1, s_q, s_kv, seed=45)
    go = cuda_randn(*q.shape, seed=46)

    def attention(q, k, v):
        return ow.sdpa(q, k, v, attn_mask=mask, dropout_p=0.3)

    torch.manual_seed(7)
    plain = run_by_backward(attention, q, k, v, go)
    torch.manual_seed(7)
    ckpt = run_by_backward(lambda *xs: checkpoint(attention, *xs, use_reentrant=True),
                           q, k, v, go)
    assert_same_draw(ckpt, plain)


# ---------------------------------------------------------------- GQA, dtypes


@pytest.mark.parametrize("data", ["random", "adversarial"])
@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_grouped_query_attention(mask_kind, data, ow, settings):
    """Hq = 8 query heads share Hkv = 2 key/value heads (enable_gqa=True);
    the reference repeats K/V with repeat_interleave, so dK/dV sum over the
    four query heads of each group."""
    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 192
    q, k, v = _inputs(data, s_q, s_kv, seed=31, H=8, Hkv=2)
    assert k.shape[1] == 2 and q.shape[1] == 8
    mask = cuda_mask(mask_kind, B, 1, s_q, s_kv, seed=32)
    go = cuda_randn(*q.shape, seed=33)
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask, enable_gqa=True)
    assert ours.dk.shape == k.shape and ours.dv.shape == v.shape
    _check_against_reference(ours, q, k, v, go, attn_mask=mask, enable_gqa=True,
                             low_rows=(9,) if data == "adversarial" else ())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_dtypes(dtype, ow, settings):
    settings(cudnn="1", pad="auto")
    s_q, s_kv = 256, 704
    q, k, v = cuda_adversarial_qkv(B, H, s_q, s_kv, D, (9,), dtype=dtype, seed=41)
    mask = cuda_mask("bool", B, 1, s_q, s_kv, seed=42)
    go = cuda_randn(*q.shape, dtype=dtype, seed=43)
    assert ow.explain(q, k, v, attn_mask=mask)["backend"] == "cudnn"
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask)
    assert ours.out.dtype == dtype and ours.dq.dtype == dtype
    _check_against_reference(ours, q, k, v, go, dtype=dtype, attn_mask=mask, low_rows=(9,))


# ---------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("cudnn,backend", [("1", "cudnn"), ("0", "pytorch")])
def test_fully_masked_row_gives_zero_output_and_gradient(cudnn, backend, mask_kind, ow, settings):
    """A query row whose mask hides every key: output 0 and dQ 0, whichever
    backend runs. (Stock cuDNN turns a bool mask into -65504 and lets such a
    row attend to every key.) s_kv = 192: the auto plan's padding-mask backward
    meets the row's logsumexp of -inf and must leave zeros there, not NaN."""
    settings(cudnn=cudnn, pad="auto")
    s_q, s_kv, d, empty = 128, 192, 64, 10
    q, k, v = cuda_qkv(B, H, s_q, s_kv, d, seed=51)
    mask = cuda_mask(mask_kind, B, 1, s_q, s_kv, empty_rows=(empty,), seed=52)
    go = cuda_randn(*q.shape, seed=53)
    assert ow.explain(q, k, v, attn_mask=mask)["backend"] == backend
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask)
    assert nonfinite(ours.out) + nonfinite_grads(ours) == 0
    assert torch.all(ours.out[:, :, empty] == 0)
    assert torch.all(ours.dq[:, :, empty] == 0)
    ref, _ = reference(q, k, v, go, attn_mask=mask)
    for name in ("out", "dq", "dk", "dv"):
        assert_close_to_reference(name, getattr(ours, name), getattr(ref, name), BF16)


# ---------------------------------------------------------------- fp32 fallback


@pytest.mark.parametrize("pad,plan", [("auto", "none"), ("always", "none")])
def test_fp32_falls_back_to_pytorch(pad, plan, ow, settings):
    """cuDNN attention takes fp16/bf16 only: fp32 goes to PyTorch's kernels
    even with OPENWAM_SDPA_CUDNN=1 (the pad setting concerns cuDNN only)."""
    settings(cudnn="1", pad=pad)
    s_q, s_kv = 128, 192
    q, k, v = cuda_qkv(B, H, s_q, s_kv, 64, dtype=torch.float32, seed=61)
    mask = cuda_mask("bool", B, 1, s_q, s_kv, seed=62)
    go = cuda_randn(*q.shape, dtype=torch.float32, seed=63)
    info = ow.explain(q, k, v, attn_mask=mask)
    assert info["backend"] == "pytorch" and info["plan"] == plan, info
    ours = run(ow.sdpa, q, k, v, go, attn_mask=mask)
    ref, _ = reference(q, k, v, go, attn_mask=mask)
    for name in ("out", "dq", "dk", "dv"):
        x, r = getattr(ours, name), getattr(ref, name)
        # fp32 kernels land within ~1e-6 of the reference; 1e-3 of the
        # largest entry still catches any wrong mask, scale or padding.
        err, bound = float((x.double() - r).abs().max()), 1e-3 * float(r.abs().max())
        assert err <= bound, f"{name}: error {err:.3e} > {bound:.3e}"


# ---------------------------------------------------------------- debug switch


# The error is raised on the autograd engine's CUDA thread. On 2026-11-30 it
# ended the whole pytest process with a segfault while formatting the message
# (the extension had been built by a compiler that linked a private copy of
# libstdc++; setup.py's BuildAndCheckLinkage now refuses such builds), so it
# runs in a child process: a crash fails this test instead of the suite.
_CHECK_FINITE_CHILD = """
import torch, openwam_sdpa as ow
from openwam_sdpa.adversarial import adversarial_inputs
q, k, v, go, _ = adversarial_inputs(2, 4, 256, 704, 128, device="cuda")
q, k, v = (t.requires_grad_() for t in (q, k, v))
info = ow.explain(q, k, v)
assert info["backend"] == "cudnn" and info["plan"] == "none", info
out = ow.sdpa(q, k, v)
try:
    torch.autograd.grad(out, (q, k, v), go)
except RuntimeError as e:
    print("RAISED:", e)
else:
    print("NO ERROR")
torch.cuda.synchronize()
"""


def test_check_finite_raises_where_stock_gives_nan(ow):
    """PAD=never is stock behaviour: on an affected shape the adversarial rows
    get NaN in dQ, and OPENWAM_SDPA_CHECK_FINITE=1 turns that into an error
    that names the logsumexp."""
    if not stock_defect_measured(704, D):
        pytest.skip(f"stock cuDNN was measured to give NaN at s_kv=704 on cuDNN 9.19.0 "
                    f"only; this is {cudnn_version()}")
    env = {**os.environ, "OPENWAM_SDPA_CUDNN": "1", "OPENWAM_SDPA_PAD": "never",
           "OPENWAM_SDPA_CHECK_FINITE": "1"}
    child = subprocess.run([sys.executable, "-c", _CHECK_FINITE_CHILD], env=env,
                           capture_output=True, text=True, timeout=300)
    log = f"exit {child.returncode}\nstdout:\n{child.stdout}\nstderr:\n{child.stderr[-3000:]}"
    assert child.returncode == 0, log
    assert "RAISED:" in child.stdout, log
    assert re.search(r"openwam::sdpa: non-finite gradient.*dQ [1-9]", child.stdout), log
    assert re.search(r"smallest logsumexp -(8[89]|9\d|1\d\d)", child.stdout), log


def test_check_finite_is_silent_with_the_fix(ow, settings):
    settings(cudnn="1", pad="auto", check_finite="1")
    s_q, s_kv = 256, 704
    q, k, v = cuda_adversarial_qkv(B, H, s_q, s_kv, D, (9,), seed=71)
    go = cuda_randn(*q.shape, seed=72)
    ours = run(ow.sdpa, q, k, v, go)
    assert nonfinite(ours.out) + nonfinite_grads(ours) == 0


@pytest.mark.parametrize("name,value", [("OPENWAM_SDPA_PAD", "sometimes"),
                                        ("OPENWAM_SDPA_CUDNN", "yes")])
def test_invalid_setting_is_an_error(name, value, ow, monkeypatch):
    monkeypatch.setenv(name, value)
    q, k, v = cuda_qkv(1, 2, 64, 64 + KEY_TILE, 64, seed=81)
    with pytest.raises(RuntimeError, match=name):
        ow.reload_settings()
    with pytest.raises(RuntimeError, match=name):
        ow.sdpa(q, k, v)

