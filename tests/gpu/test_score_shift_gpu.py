"""The score shift's CUDA kernels (csrc/cuda/score_shift.cu) through the leaf
ops, plan shift_scores (16) against the padding mask's plan (1) on the same
inputs: every bias shape the kernels lay out differently (a warp per bias row
where few logsumexp entries read it, a block where many do; entries read in
one contiguous run or strided; the bias raised into a copy or in place), the
shift in the forward (a key mask's, the logsumexp in place) and in the
backward, bf16 and fp16, adversarial rows, ordinary rows and fully masked
rows. The bias the caller holds must come back unchanged, the gradients must be finite
and as close to float64 as the padding mask's, and the telemetry must count
the shifted backwards. An fp16 row whose logsumexp is about -20 is shifted
too: there exp(0 - lse) passes fp16's largest value (score_shift.h).
"""

from __future__ import annotations

import math

import pytest
import torch
from openwam_sdpa.adversarial import adversarial_inputs

from support import reference

from .conftest import GPU_MARKS, cuda_adversarial_qkv, cuda_randn

pytestmark = GPU_MARKS

FWD = torch.ops.openwam._cudnn_sdpa.default
BWD = torch.ops.openwam._cudnn_sdpa_backward.default
PADDING_MASK, SHIFT_SCORES = 1, 16
B, H, S_Q, S_KV, D = 2, 4, 96, 320, 64  # s_kv % 128 == 64: the key tail

# (query rows, bias shape): each lays the kernel out another way. A bias row
# read by at most 256 logsumexp entries gets a warp, else a block; a row whose
# entries are one contiguous run of the logsumexp is read into registers. A
# bias without query rows is shifted by the forward, into a copy; at the
# backward (shift_at "backward" below), a bias of no more bytes than the
# logsumexp is raised into a copy, a larger one in place and restored.
BIAS_CASES = {
    "rows": (S_Q, (B, 1, S_Q, S_KV)),    # a warp a row (H entries), strided; in place
    "keys": (S_Q, (B, 1, 1, S_KV)),      # a block (H * L = 384), contiguous; copy
    "batch": (S_Q, (1, 1, S_Q, S_KV)),   # broadcast over the batch: a warp, strided; in place
    "keys_short": (32, (B, 1, 1, S_KV)),  # a warp (H * L = 128), contiguous; backward: in place
    "heads_long": (160, (1, H, 1, S_KV)),  # a block (B * L = 320), strided; copy
}


def bool_bias(shape, dtype, seed, masked_row=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(shape, device="cuda", generator=g) < 0.8
    keep[..., 0] = True
    if masked_row is not None and shape[2] > 1:
        keep[..., masked_row, :] = False  # a row that sees no key
    bias = torch.zeros(shape, device="cuda", dtype=dtype).masked_fill(~keep, -math.inf)
    return bias, keep


def leaf_grads(q, k, v, go, bias, plan, shift_at="forward"):
    """The leaf ops as the autograd node calls them: where the forward
    shifted (its raised bias has keys), the backward takes the raised bias
    and a plan without the shift. shift_at "backward": the forward runs
    without the plan's shift, so that the backward shifts."""
    fwd_plan = plan & ~SHIFT_SCORES if shift_at == "backward" else plan
    out, lse, seed, offset, raised = FWD(q, k, v, bias, 0.0, False, None, True, fwd_plan)
    shifted_in_forward = raised.shape[-1] > 0
    assert shifted_in_forward == (plan == SHIFT_SCORES and shift_at == "forward"
                                  and bias.shape[2] == 1), raised.shape
    if shifted_in_forward:
        bias, plan = raised, plan & ~SHIFT_SCORES
    dq, dk, dv = BWD(go, q, k, v, bias, out, lse, seed, offset, 0.0, False, None, plan)
    return out, dq, dk, dv


def rel(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("shift_at", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", BIAS_CASES.values(), ids=BIAS_CASES.keys())
def test_shifted_backward_matches_the_padding_mask(case, dtype, shift_at, ow):
    """Batch 0 has adversarial rows, batch 1 none: bias rows with c > 0 and
    c == 0 in every layout (a copy writes both; in place, only the first)."""
    s_q, shape = case
    q, k, v = (t.detach() for t in
               cuda_adversarial_qkv(B, H, s_q, S_KV, D, (5, s_q - 10), dtype=dtype, seed=21))
    q = q.clone()
    q[1] = cuda_randn(H, s_q, D, seed=20).to(dtype)  # an ordinary batch element
    go = cuda_randn(B, H, s_q, D, seed=22).to(dtype)
    masked_row = s_q // 2
    bias, keep = bool_bias(shape, dtype, seed=23, masked_row=masked_row)
    held = bias.clone()
    before = ow.frontend_stats()["score_shift_backwards"]
    shifted = leaf_grads(q, k, v, go, bias, SHIFT_SCORES, shift_at)
    assert torch.equal(bias, held), "the bias was not restored"
    assert ow.frontend_stats()["score_shift_backwards"] == before + 1
    padded = leaf_grads(q, k, v, go, bias, PADDING_MASK)
    ref, lse = reference(q, k, v, go, attn_mask=keep.expand(B, shape[1], s_q, S_KV))
    assert float(lse[torch.isfinite(lse)].min()) < -88.7  # the defect's rows are there
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), shifted, padded,
                             (ref.out, ref.dq, ref.dk, ref.dv)):
        assert bool(torch.isfinite(a).all()), name
        assert rel(a, r) <= 2 * rel(b, r) + 2e-3, (name, rel(a, r), rel(b, r))
    if shape[2] > 1:  # the row that sees no key: zero output and gradient
        assert int(torch.count_nonzero(shifted[1][:, :, masked_row])) == 0


@pytest.mark.skipif(torch.backends.cudnn.version() != 91900,
                    reason="the score shift is the plan on cuDNN 9.19.0 only (measured there)")
@pytest.mark.parametrize("mask_rows", [S_Q, 1], ids=["rows_backward_shift", "keys_forward_shift"])
def test_fp16_rows_near_minus_20_are_shifted(mask_rows, ow, settings):
    """fp16: cuDNN rounds dS to fp16 for its dQ product, so the tail's
    exp(0 - lse) overflows from a logsumexp of -11.1; the shift takes every
    fp16 row below 0 (score_shift.h). Through the public op, at default
    settings, a mask with query rows (shifted at the backward) and a key
    mask (shifted in the forward): finite, and as accurate as the float64
    reference allows."""
    settings(cudnn="1", pad="auto")
    target = -20.0 - math.log(S_KV)
    a = adversarial_inputs(B, H, S_Q, S_KV, D, rows="one_per_head", target=target,
                           dtype=torch.float16, device="cuda", seed=24, requires_grad=True)
    mask = torch.ones(B, 1, mask_rows, S_KV, device="cuda", dtype=torch.bool)
    info = ow.explain(a.query, a.key, a.value, attn_mask=mask)
    assert info["plan"] == "shift_scores", info
    before = ow.frontend_stats()["score_shift_backwards"]
    out = ow.sdpa(a.query, a.key, a.value, attn_mask=mask)
    grads = torch.autograd.grad(out, (a.query, a.key, a.value), a.grad_out)
    assert ow.frontend_stats()["score_shift_backwards"] == before + 1
    ref, lse = reference(a.query, a.key, a.value, a.grad_out, attn_mask=mask)
    low = float(lse[a.affected].max())
    assert -40 < low < -11.1, low
    for name, g, r in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv)):
        assert bool(torch.isfinite(g).all()), name
        assert rel(g, r) < 2e-2, (name, rel(g, r))


def test_a_bias_the_shift_cannot_write_raises(ow):
    """A direct call of the backward with plan shift_scores and a bias whose
    keys share memory (stride 0) raises instead of raising one key S times."""
    q, k, v = (t.detach() for t in cuda_adversarial_qkv(B, H, S_Q, S_KV, D, (5,), seed=25))
    go = cuda_randn(B, H, S_Q, D, seed=26)
    bias = torch.zeros(B, 1, S_Q, S_KV, device="cuda", dtype=torch.bfloat16)
    out, lse, seed, offset, raised = FWD(q, k, v, bias, 0.0, False, None, True, SHIFT_SCORES)
    with pytest.raises(RuntimeError, match="needs a 4-D bias with contiguous keys"):
        BWD(go, q, k, v, bias[..., :1].expand(bias.shape), out, lse, seed, offset, 0.0, False,
            None, SHIFT_SCORES)


def test_one_query_row_with_a_bool_mask(ow, settings):
    """Batch 1, one query row, a bool mask, the key tail: the plan holds the
    one-row fix and the shift (the one-row backward itself runs in fp32)."""
    settings(cudnn="1", pad="auto")
    q, k, v = cuda_adversarial_qkv(1, H, 1, S_KV, D, (0,), seed=27)
    go = cuda_randn(1, H, 1, D, seed=28)
    mask = torch.rand(1, 1, 1, S_KV, device="cuda") < 0.8
    mask[..., 0] = True
    info = ow.explain(q, k, v, attn_mask=mask)
    assert info["route"] == "cudnn", info
    assert {"pad_query_backward", "shift_scores"} <= set(info["plan"].split("+")), info
    out = ow.sdpa(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), go)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
