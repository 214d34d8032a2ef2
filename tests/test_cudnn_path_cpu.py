"""The guarded cuDNN path's two leaf ops on the CPU.

openwam::_cudnn_sdpa and openwam::_cudnn_sdpa_backward carry the fix: the
plan. On CUDA the op's own cuDNN graphs run the backward with cuDNN's padding
mask; where the frontend cannot build a graph, ATen's cuDNN attention runs on
padded inputs instead (the keys padded to a multiple of 128, a second query
row). Their CPU kernels run that padding code around an exact fp32 attention
instead of cuDNN (csrc/cudnn_path_kernels.cpp; the padding mask is a no-op
there), so that what surrounds cuDNN is tested here: every plan must give
what the unpadded attention gives, the ops must pass opcheck, and
torch.compile must keep them as leaves, the backward (and with it the fix)
included. The public op never routes a CPU call here; the GPU suite checks
that on the real path.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch

import openwam_sdpa  # noqa: F401  (registers the ops)
from support import assert_close, call_targets, make_mask, qkv, reference, traced_graphs

FWD = torch.ops.openwam._cudnn_sdpa.default
BWD = torch.ops.openwam._cudnn_sdpa_backward.default

# Plan bits (csrc/plan.cpp).
PADDING_MASK, PAD_KEYS_BACKWARD, PAD_KEYS_FORWARD, PAD_QUERY_BACKWARD = 1, 2, 4, 8
SHIFT_SCORES = 16
KEY_TAIL = PADDING_MASK | PAD_KEYS_BACKWARD  # a key-tail guard row's plan (no bool mask)
# Every plan the guard table and OPENWAM_SDPA_PAD give, by the name explain() shows.
PLANS = {"none": 0, "padding_mask": PADDING_MASK,
         "padding_mask+pad_keys_backward": KEY_TAIL,
         "padding_mask+pad_keys_forward": PADDING_MASK | PAD_KEYS_FORWARD,
         "padding_mask+pad_query_backward": PADDING_MASK | PAD_QUERY_BACKWARD,
         "padding_mask+pad_keys_backward+pad_query_backward": KEY_TAIL | PAD_QUERY_BACKWARD}

CASES = {
    # name: dict(B, H, Hkv, L, S, E, mask kind, is_causal, layout)
    "plain": dict(),
    "bool_mask": dict(mask="bool"),
    "additive_mask": dict(mask="additive"),
    "key_padding_mask": dict(mask="key_bool"),
    "rank2_mask": dict(mask="bool", rank=2),
    "causal_l_lt_s": dict(is_causal=True, L=5),
    "causal_l_gt_s": dict(is_causal=True, L=80),
    "gqa": dict(H=4, Hkv=2),
    "value_head_dim": dict(Ev=24),
    "value_head_dim_bshd": dict(Ev=24, layout="bshd", mask="bool"),
    "bshd": dict(mask="bool", layout="bshd"),
    "aligned_keys": dict(S=128),
    "one_key_over": dict(S=129),
}


def inputs(B=2, H=3, Hkv=None, L=6, S=70, E=16, Ev=None, mask="none", rank=4,
           is_causal=False, layout="bhsd", one_row=False, seed=0):
    if one_row:
        B, L = 1, 1
    q, k, v = qkv(B, H, L, S, E, Hkv=Hkv, Ev=Ev, dtype=torch.float32, layout=layout,
                  seed=seed, requires_grad=True)
    m = make_mask(mask, B, H, L, S, rank=rank, dtype=torch.float32)
    bias = None
    if m is not None:
        bias = m if m.dtype != torch.bool else torch.zeros(m.shape).masked_fill(~m, -math.inf)
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
    return (q, k, v), m, bias, is_causal


def run(q, k, v, bias, is_causal, plan, grad_out):
    out, lse, _, _, _ = FWD(q, k, v, bias, 0.0, is_causal, None, True, plan)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, lse, (dq, dk, dv)


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_plan_gives_the_unpadded_attention(case, plan):
    one_row = bool(plan & PAD_QUERY_BACKWARD)  # the plan for batch 1, one query row
    if one_row and case.get("is_causal"):
        case = dict(case, L=1)
    (q, k, v), mask, bias, causal = inputs(**case, one_row=one_row)
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(3))
    out, lse, g = run(q, k, v, bias, causal, plan, grad_out)
    ref, ref_lse = reference(q, k, v, grad_out, mask, causal, enable_gqa=True)
    assert_close(out.double(), ref.out, 2e-5, 2e-5, "out")
    assert_close(lse.squeeze(-1).double(), ref_lse, 2e-5, 2e-5, "logsumexp")
    for name, a, b, x in zip(("dq", "dk", "dv"), g, ref[1:], (q, k, v)):
        assert a.shape == x.shape and a.stride() == torch.empty_like(x).stride(), name
        assert_close(a.double(), b, 5e-5, 5e-5, name)


BOOL_CASES = {name: c for name, c in CASES.items() if c.get("mask") in ("bool", "key_bool")}


def lift_rows(q, k, rows):
    """Query `rows` ((b, h, i) triples) pointed against a key component every
    key shares, so that their logits are all about -110 and their
    logsumexp far below -88.7: the rows the shift raises."""
    E = q.shape[-1]
    u = torch.full((E,), E ** -0.5)
    with torch.no_grad():
        k.add_(30 * u)
        for b, h, i in rows:
            q[b, h, i] = -(110 / (30 * E ** -0.5)) * u


@pytest.mark.parametrize("case", BOOL_CASES.values(), ids=BOOL_CASES.keys())
def test_shifted_scores_give_the_unshifted_attention(case):
    """The plan shift_scores (a bool mask's key-tail fix) runs the backward on
    the bias and the logsumexp raised by a power of two per bias row
    (csrc/score_shift.h): the gradients must be the unshifted attention's,
    and the bias the caller holds must come back unchanged."""
    (q, k, v), mask, bias, causal = inputs(**case)
    lift_rows(q, k, [(0, 1, 2), (1, 0, 4)])
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(3))
    held = bias.clone()
    out, lse, g = run(q, k, v, bias, causal, SHIFT_SCORES, grad_out)
    ref, ref_lse = reference(q, k, v, grad_out, mask, causal, enable_gqa=True)
    assert ref_lse.min() < -90  # the shift had rows to raise
    # A key mask's forward shifts (its logsumexp comes back shifted: float
    # shifts rows below -32); a bias with query rows is shifted at the backward.
    forward_shift = bias.shape[2] == 1
    assert (lse.min() >= -32) == forward_shift, float(lse.min())
    assert torch.equal(bias, held)
    assert_close(out.double(), ref.out, 2e-5, 2e-5, "out")
    for name, a, b in zip(("dq", "dk", "dv"), g, ref[1:]):
        assert_close(a.double(), b, 5e-5, 5e-5, name)


def test_a_key_mask_is_shifted_in_the_forward():
    """plan shift_scores with a key mask [B, 1, 1, S]: the forward returns its
    logsumexp shifted and the bias raised by the same power of two per bias
    row (csrc/score_shift.h); the autograd node keeps the raised bias, not
    the bias, and its backward runs without a shift of its own. The
    gradients are the unshifted attention's. A bias with query rows comes
    back with no keys (shifted at the backward)."""
    (q, k, v), mask, bias, _ = inputs(mask="key_bool")
    lift_rows(q, k, [(0, 1, 2), (1, 0, 4)])
    grad_out = torch.randn(2, 3, 6, 16, generator=torch.Generator().manual_seed(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse, _, _, raised = FWD(q, k, v, bias, 0.0, False, None, True, SHIFT_SCORES)
    ref, ref_lse = reference(q, k, v, grad_out, mask, False, enable_gqa=True)
    assert raised.shape == bias.shape and raised.stride() == bias.stride()
    finite = torch.isfinite(bias)
    assert torch.equal(finite, torch.isfinite(raised))
    lift = (raised - bias).where(finite, 0)
    c = lift.amax(dim=(1, 2, 3))  # one c per bias row: each batch element's
    assert torch.equal(lift, c.view(-1, 1, 1, 1).expand_as(bias).where(finite, 0))
    for b, cb in enumerate(c.tolist()):  # a power of two that lifts the row's logsumexp to >= 0
        assert cb == 2.0 ** round(math.log2(cb)) and cb >= -float(ref_lse[b].min()), (b, cb)
    assert_close(lse.squeeze(-1).double(), ref_lse + c.view(-1, 1, 1).double(), 2e-5, 2e-5,
                 "shifted logsumexp")
    held = {t.data_ptr() for t in saved}
    assert raised.data_ptr() in held and bias.data_ptr() not in held
    g = torch.autograd.grad(out, (q, k, v), grad_out)
    for name, a, b in zip(("dq", "dk", "dv"), g, ref[1:]):
        assert_close(a.double(), b, 5e-5, 5e-5, name)
    (q, k, v), _, rows_bias, _ = inputs(mask="bool")
    raised = FWD(q, k, v, rows_bias, 0.0, False, None, True, SHIFT_SCORES)[4]
    assert raised.shape == rows_bias.shape[:-1] + (0,)


def test_traced_key_mask_backward_takes_the_raised_bias():
    """Under AOTAutograd the forward's raised bias feeds the backward op,
    whose plan no longer shifts (the Meta kernel gives the raised bias the
    bias's layout, so the trace matches the run)."""
    (q, k, v), _, bias, _ = inputs(mask="key_bool")
    graphs = traced_graphs(
        lambda q, k, v, b: FWD(q, k, v, b, 0.0, False, None, True, SHIFT_SCORES)[0], q, k, v, bias)
    node = next(n for n in graphs["backward"].graph.nodes
                if str(n.target) == "openwam._cudnn_sdpa_backward.default")
    assert node.args[-1] == 0
    assert tuple(node.args[4].meta["val"].shape) == tuple(bias.shape)
    fwd = graphs["forward"].graph
    leaf = next(n for n in fwd.nodes if str(n.target) == "openwam._cudnn_sdpa.default")
    saved = next(n for n in fwd.nodes if n.op == "output").args[0]
    # The forward hands its raised bias (output 4) to the backward, not the bias.
    assert any(isinstance(n, torch.fx.Node) and n.target is operator.getitem
               and n.args == (leaf, 4) for n in saved)
    assert not any(isinstance(n, torch.fx.Node) and n.op == "placeholder"
                   and tuple(n.meta["val"].shape) == tuple(bias.shape) for n in saved)


def test_shift_scores_needs_a_bias_with_contiguous_keys():
    """The forward refuses the plan without a bias (its backward could not
    run it); the backward refuses a bias whose keys share memory (stride 0),
    which the in-place shift would raise once per key."""
    (q, k, v), _, bias, _ = inputs(mask="bool")
    with pytest.raises(RuntimeError, match="the plan shift_scores is for calls with a bias"):
        FWD(q, k, v, None, 0.0, False, None, True, SHIFT_SCORES)
    out, lse, seed, offset, raised = FWD(q, k, v, bias, 0.0, False, None, True, SHIFT_SCORES)
    one_key = bias[..., :1].expand(bias.shape)
    with pytest.raises(RuntimeError, match="the plan shift_scores needs a 4-D bias with "
                                           "contiguous keys"):
        BWD(torch.ones_like(out), q, k, v, one_key, out, lse, seed, offset, 0.0, False, None,
            SHIFT_SCORES)


def test_the_leaf_ops_refuse_dropout_with_one_query_row():
    """cuDNN's forward faulted on dropout with a single query row (an illegal
    memory access: H100, cuDNN 9.19.0, frontend graph with the padding mask).
    openwam::sdpa hands such calls to PyTorch; both leaf ops refuse them with
    an error, never a fault, whatever the plan, and so do their Meta kernels
    (a compiled direct call fails at its trace)."""
    q, k, v = (torch.randn(1, 2, s, 8) for s in (1, 5, 5))
    out, lse, seed, offset, raised = FWD(q, k, v, None, 0.0, False, None, True, 0)
    for device in ("cpu", "meta"):
        args = [t.to(device) for t in (q, k, v, out, lse, seed, offset)]
        q_, k_, v_, out_, lse_, seed_, offset_ = args
        for plan in (0, PADDING_MASK | PAD_QUERY_BACKWARD):
            with pytest.raises(RuntimeError, match="dropout with a single query row is not run"):
                FWD(q_, k_, v_, None, 0.125, False, None, True, plan)
            with pytest.raises(RuntimeError, match="dropout with a single query row is not run"):
                BWD(torch.ones_like(out_), q_, k_, v_, None, out_, lse_, seed_, offset_, 0.125,
                    False, None, plan)


def test_a_bias_broadcast_in_memory_is_shifted_once_and_restored():
    """A bias expanded along the batch and the queries (stride 0) is one row
    in memory: the shift raises it once, for the smallest logsumexp of every
    row reading it."""
    (q, k, v), _, _, _ = inputs()
    lift_rows(q, k, [(0, 1, 2), (1, 0, 4)])
    keep = torch.rand(1, 1, 1, 70, generator=torch.Generator().manual_seed(5)) < 0.7
    keep[..., 0] = True
    row = torch.zeros(1, 1, 1, 70).masked_fill(~keep, -math.inf)
    bias = row.expand(2, 1, 6, 70)
    held = row.clone()
    grad_out = torch.randn(2, 3, 6, 16, generator=torch.Generator().manual_seed(3))
    out, lse, g = run(q, k, v, bias, False, SHIFT_SCORES, grad_out)
    assert lse.min() < -90  # shifted at the backward: the bias has query rows
    assert torch.equal(row, held)
    ref, _ = reference(q, k, v, grad_out, keep.expand(2, 1, 6, 70), False, enable_gqa=True)
    for name, a, b in zip(("dq", "dk", "dv"), g, ref[1:]):
        assert_close(a.double(), b, 5e-5, 5e-5, name)


def test_double_backward_raises_as_pytorchs_fused_backwards():
    """The backward op has no derivative. create_graph still gives the first
    derivatives; differentiating them again raises PyTorch's error for a
    backward without one (as its fused SDPA backwards do), where before
    PyTorch's fallback only warned and the second derivative was wrong."""
    (q, k, v), _, bias, causal = inputs(mask="bool")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    out = FWD(q, k, v, bias, 0.0, causal, None, True, KEY_TAIL)[0]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out, create_graph=True)
    assert_close(dq, run(q, k, v, bias, causal, KEY_TAIL, grad_out)[2][0], 0, 0, "dq")
    with pytest.raises(RuntimeError,
                       match="derivative for openwam::_cudnn_sdpa_backward is not implemented"):
        torch.autograd.grad(dq.square().sum(), k)


def test_backward_op_checks_what_its_forward_gave():
    """A direct call of the backward op with the logsumexp of a forward that
    computed none (compute_log_sumexp=False gives an empty one), or with an
    output of other sizes, raises naming them: ATen's cuDNN backward (the
    GPU fallback) would have read the empty buffer as statistics."""
    (q, k, v), _, _, _ = inputs()
    out, lse, seed, offset, raised = FWD(q, k, v, None, 0.0, False, None, True, 0)
    with torch.no_grad():  # differentiated, the forward computes it whatever it is told
        empty = FWD(q, k, v, None, 0.0, False, None, False, 0)[1]
    assert empty.numel() == 0
    go = torch.ones_like(out)
    BWD(go, q, k, v, None, out, lse, seed, offset, 0.0, False, None, 0)  # as given
    with pytest.raises(RuntimeError, match=r"logsumexp must be its forward's float32 \[B, H, L, 1\]"):
        BWD(go, q, k, v, None, out, empty, seed, offset, 0.0, False, None, 0)
    with pytest.raises(RuntimeError, match=r"out and grad_out must be \[B, H, L, Ev\]"):
        BWD(go, q, k, v, None, out[:, :, :-1], lse, seed, offset, 0.0, False, None, 0)


def test_forward_mode_ad_raises():
    """No tangent formula: forward AD raises NotImplementedError, as PyTorch's
    own cuDNN attention does, instead of leaving the output without one."""
    import torch.autograd.forward_ad as fwAD

    (q, k, v), _, bias, causal = inputs()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q.detach(), torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward AD with openwam::_cudnn_sdpa"):
            FWD(dual, k.detach(), v.detach(), bias, 0.0, causal, None, True, 0)


# The K/V shim's backward in slices (csrc/shim_slices.h; the CPU reference
# slices wherever memory says). 512 queries over 70 keys (128 padded), 2
# heads, head_dim 8: without a mask a slice of 2 batch elements fits stock's
# workspace and 4 do not (2 slices); a key mask per batch element adds its
# padded rows, and one element a slice fits (4 slices); with is_causal the
# causal mask is built once for every slice, as is a mask broadcast over
# batch and heads; GQA splits one element's heads by group; a key mask per
# element over heads split one a slice is padded once per element.
SLICED = {"two_batch_elements": dict(B=4, H=2, L=512, S=70, E=8),
          "one_batch_element_key_mask": dict(B=4, H=2, L=512, S=70, E=8, mask="key_bool"),
          "causal": dict(B=4, H=2, L=512, S=70, E=8, is_causal=True),
          "broadcast_mask": dict(B=4, H=2, L=512, S=70, E=8, mask="bool", rank=2),
          "grouped_heads": dict(B=2, H=4, Hkv=2, L=512, S=200, E=8, mask="additive"),
          "key_mask_heads_split": dict(B=2, H=4, L=512, S=70, E=8, mask="key_additive")}


@pytest.mark.parametrize("case", SLICED.values(), ids=SLICED.keys())
def test_the_shim_backward_in_slices_gives_the_unpadded_attention(case):
    (q, k, v), mask, bias, causal = inputs(**case)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    out, lse, g = run(q, k, v, bias, causal, KEY_TAIL, grad_out)
    ref, _ = reference(q, k, v, grad_out, mask, causal, enable_gqa=True)
    for name, a, b, x in zip(("dq", "dk", "dv"), g, ref[1:], (q, k, v)):
        assert a.shape == x.shape and a.stride() == torch.empty_like(x).stride(), name
        assert_close(a.double(), b, 5e-5, 5e-5, name)


def _padded_bias(bias, s_kv_padded):
    """`bias` with its keys grown to s_kv_padded, -inf there: what run_cudnn_path
    passes the leaf ops for a K/V shim backward (cudnn_bias with s_kv_padded)."""
    grown = torch.full(bias.shape[:-1] + (s_kv_padded,), -math.inf, dtype=bias.dtype)
    grown[..., : bias.shape[-1]] = bias
    return grown


# A bias that comes padded: the forward reads its first s_kv keys, the shim's
# backward takes it as it is (no padded copy), every other backward its keys.
PADDED_BIAS = {"shim": dict(mask="bool", plan=KEY_TAIL),
               "shim_in_slices": dict(B=4, H=2, L=512, S=70, E=8, mask="key_bool", plan=KEY_TAIL),
               "grouped_heads_additive": dict(H=4, Hkv=2, mask="additive", plan=KEY_TAIL),
               "one_query_row": dict(one_row=True, mask="bool",
                                     plan=KEY_TAIL | PAD_QUERY_BACKWARD),
               "padding_mask_alone": dict(mask="bool", plan=PADDING_MASK)}


@pytest.mark.parametrize("case", PADDED_BIAS.values(), ids=PADDED_BIAS.keys())
def test_a_padded_bias_gives_what_the_bias_gives(case):
    case = dict(case)
    plan = case.pop("plan")
    (q, k, v), _, bias, causal = inputs(**case)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    out, lse, g = run(q, k, v, bias, causal, plan, grad_out)
    p_out, p_lse, p_g = run(q, k, v, _padded_bias(bias, 128), causal, plan, grad_out)
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)
    for name, a, b in zip(("dq", "dk", "dv"), g, p_g):
        assert a.shape == b.shape and a.stride() == b.stride(), name
        assert_close(a, b, 1e-6, 1e-6, name)


def test_a_bias_of_another_key_length_raises():
    (q, k, v), _, bias, causal = inputs(mask="bool")
    with pytest.raises(RuntimeError, match=r"attn_bias's last dim must be the key length \(70\) "
                                           r"or, padded for the K/V shim, 128; got 100"):
        run(q, k, v, _padded_bias(bias, 100), causal, KEY_TAIL, torch.ones(q.shape))


def test_the_forward_refuses_what_its_backward_cannot_take():
    """A bias with is_causal (decide() folds neither into the other: such a
    call never takes this path) had passed the forward and died of an
    internal assert in the backward; the one-row plan on several rows had
    passed it too (opcheck on direct calls; found in review)."""
    (q, k, v), _, bias, _ = inputs(mask="additive")
    with pytest.raises(RuntimeError, match="takes an attn_bias or is_causal, not both"):
        FWD(q, k, v, bias, 0.0, True, None, False, 0)
    with pytest.raises(RuntimeError, match="pad_query_backward is for a single query row, got 6"):
        FWD(q, k, v, None, 0.0, False, None, True, PADDING_MASK | PAD_QUERY_BACKWARD)


def test_pad_keys_forward_keeps_outputs():
    """The dropout plan runs the forward on padded keys too: same outputs."""
    (q, k, v), mask, bias, causal = inputs(mask="bool")
    a = FWD(q, k, v, bias, 0.0, causal, None, True, 0)
    b = FWD(q, k, v, bias, 0.0, causal, None, True, PAD_KEYS_FORWARD)
    assert_close(a[0], b[0], 1e-6, 1e-6, "out")
    assert_close(a[1], b[1], 1e-5, 1e-6, "logsumexp")


def test_the_padding_mask_changes_nothing_on_the_cpu():
    """The padding mask is the frontend's (CUDA) fix: on the reference engine
    a plan that differs only by it gives the same bits."""
    (q, k, v), _, bias, causal = inputs(mask="bool")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    for without in (0, PAD_KEYS_BACKWARD):
        a_out, a_lse, a_g = run(q, k, v, bias, causal, without, grad_out)
        b_out, b_lse, b_g = run(q, k, v, bias, causal, without | PADDING_MASK, grad_out)
        assert torch.equal(a_out, b_out) and torch.equal(a_lse, b_lse)
        assert all(torch.equal(a, b) for a, b in zip(a_g, b_g))


@pytest.mark.parametrize("plan", [0, PADDING_MASK, KEY_TAIL, SHIFT_SCORES])
def test_fully_masked_rows_get_zero_output_and_gradient(plan):
    (q, k, v), _, _, _ = inputs()
    bias = torch.zeros(2, 1, 6, 70)
    bias[:, :, 2] = -math.inf  # query row 2 sees no key
    grad_out = torch.ones(2, 3, 6, 16)
    out, lse, (dq, dk, dv) = run(q, k, v, bias, False, plan, grad_out)
    assert torch.count_nonzero(out[:, :, 2]) == 0
    assert torch.isneginf(lse[:, :, 2]).all()
    assert torch.count_nonzero(dq[:, :, 2]) == 0
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    # Every other value is the float64 reference's (the masked row adds
    # nothing to dK and dV).
    ref, _ = reference(q, k, v, grad_out, bias != -math.inf, False, enable_gqa=True)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert_close(got.double(), want, 5e-5, 5e-5, name)


def test_the_one_row_backward_is_as_accurate_as_bf16_allows():
    # Batch 1, one query row (plan pad_query_backward): dQ in fp32, rounded
    # once to bf16. Its delta (the row's sum of P * dP) once came from the
    # bf16 output instead, and where one key component dominates (keys with
    # a shared offset) that rounding cancelled into dQ: 2.45x stock cuDNN's
    # error in the GPU fuzz (seed 89004, case 66: head_dim 256, 1,123 keys).
    g = torch.Generator().manual_seed(0)
    H, S, E = 8, 1123, 256
    q, go = (torch.randn(1, H, 1, E, generator=g) for _ in range(2))
    k, v = (torch.randn(1, H, S, E, generator=g) for _ in range(2))
    k[..., 0] += 10.0
    q, k, v, go = (t.to(torch.bfloat16) for t in (q, k, v, go))
    q.requires_grad_()
    out, lse, _, _, _ = FWD(q, k, v, None, 0.0, False, None, True, PADDING_MASK | PAD_QUERY_BACKWARD)
    (dq,) = torch.autograd.grad(out, (q,), go)
    q64 = q.detach().double().requires_grad_()
    want = torch.nn.functional.scaled_dot_product_attention(q64, k.double(), v.double())
    (want_dq,) = torch.autograd.grad(want, (q64,), go.double())
    err = (dq.double() - want_dq).abs().amax(dim=(-1, -2))
    rounding = (want_dq.to(torch.bfloat16).double() - want_dq).abs().amax(dim=(-1, -2))
    assert torch.all(err <= 1.25 * rounding), (err / rounding).tolist()


def test_the_one_row_backward_takes_its_softmax_from_its_own_scores():
    # One causal query over 1,856 keys sees key 0 alone: dQ and dK are 0
    # exactly. Its logit near -110 lies where an fp32 ulp is 7.6e-6, and
    # cuDNN's logsumexp, computed in another order, can differ from these
    # scores' by a few ulps. Read from the forward, that offset was all of
    # dQ: 235x stock's error in the GPU fuzz (H100, cuDNN 9.19.0, fp16). The
    # backward must not depend on it.
    g = torch.Generator().manual_seed(0)
    H, S, E = 4, 1856, 64
    q = torch.randn(1, H, 1, E, generator=g)
    k, v, go = (torch.randn(1, H, n, E, generator=g) for n in (S, S, 1))
    k[:, :, 0] = -q[:, :, 0] * (110 * math.sqrt(E) / q[:, :, 0].square().sum(-1, keepdim=True))
    q, k, v, go = (t.half() for t in (q, k, v, go))
    plan = PADDING_MASK | PAD_QUERY_BACKWARD
    out, lse, seed, offset, raised = FWD(q, k, v, None, 0.0, True, None, True, plan)
    assert float(lse.max()) < -100  # the adversarial row
    grads = []
    for shift in (0, 3):
        off = lse
        for _ in range(shift):  # a few fp32 ulps, as cuDNN's own sum gives
            off = torch.nextafter(off, torch.full_like(off, math.inf))
        grads.append(BWD(go, q, k, v, None, out, off, seed, offset, 0.0, True, None, plan))
    for dq, dk, dv in grads:
        assert dq.abs().max() == 0 and dk.abs().max() == 0
        assert torch.equal(dv[:, :, 0], go[:, :, 0]) and dv[:, :, 1:].abs().max() == 0


def test_logsumexp_is_empty_unless_asked():
    (q, k, v), _, _, _ = inputs()
    out, lse, _, _, _ = FWD(q.detach(), k.detach(), v.detach(), None, 0.0, False, None, False, 0)
    assert lse.numel() == 0 and out.shape == q.shape


def test_a_call_recorded_without_gradients_trains():
    """An exported program after run_decompositions() holds the leaf op as its
    no-grad trace called it (compute_log_sumexp=False, the empty plan). Run
    with inputs that require grad, the call takes the training forward and the
    plan decide() gives a differentiated call (on the CPU, with no cuDNN:
    none): its gradients are the attention's. It had raised."""
    (q, k, v), mask, bias, causal = inputs(mask="bool")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    out, lse, _, _, _ = FWD(q, k, v, bias, 0.0, causal, None, False, 0)
    assert lse.numel() > 0
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, _ = reference(q, k, v, grad_out, mask, causal, enable_gqa=True)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref[1:]):
        assert_close(a.double(), b, 5e-5, 5e-5, name)


def test_invalid_plan_raises():
    (q, k, v), _, _, _ = inputs()
    with pytest.raises(RuntimeError, match="plan must be a combination of the plan flags"):
        FWD(q, k, v, None, 0.0, False, None, True, 64)


# --------------------------------------------------------------------------
# opcheck: schemas, fake (Meta) kernels, autograd registration, AOT dispatch
# --------------------------------------------------------------------------

OPCHECK = {
    "plain": dict(),
    "bool_mask_padding_mask": dict(mask="bool", plan=PADDING_MASK),
    "bool_mask_shift_scores": dict(mask="bool", plan=SHIFT_SCORES),
    "key_mask_shift_scores": dict(mask="key_bool", plan=SHIFT_SCORES),  # shifts in the forward
    "causal_key_tail": dict(is_causal=True, plan=KEY_TAIL),
    "gqa_bshd": dict(H=4, Hkv=2, layout="bshd"),
    "one_row_pad_query": dict(one_row=True, plan=PAD_QUERY_BACKWARD | PADDING_MASK),
}


@pytest.mark.parametrize("case", OPCHECK.values(), ids=OPCHECK.keys())
def test_opcheck_forward(case):
    case = dict(case)
    plan = case.pop("plan", 0)
    (q, k, v), _, bias, causal = inputs(**case, S=40)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    bias = None if bias is None else bias.bfloat16()
    torch.library.opcheck(FWD, (q, k, v, bias, 0.0, causal, None, True, plan))


@pytest.mark.parametrize("case", OPCHECK.values(), ids=OPCHECK.keys())
def test_opcheck_backward(case):
    case = dict(case)
    plan = case.pop("plan", 0)
    (q, k, v), _, bias, causal = inputs(**case, S=40)
    q, k, v = (t.detach().bfloat16() for t in (q, k, v))
    bias = None if bias is None else bias.bfloat16()
    out, lse, seed, offset, raised = FWD(q, k, v, bias, 0.0, causal, None, True, plan)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(BWD, (grad_out, q, k, v, bias, out, lse, seed, offset, 0.0, causal,
                                None, plan))


# --------------------------------------------------------------------------
# torch.compile keeps both ops as leaves: the fix is in the backward graph
# --------------------------------------------------------------------------


def test_traced_backward_graph_holds_the_ops_backward():
    (q, k, v), _, bias, _ = inputs(mask="bool")
    plan = KEY_TAIL
    graphs = traced_graphs(lambda q, k, v, b: FWD(q, k, v, b, 0.0, False, None, True, plan)[0],
                           q, k, v, bias)
    fwd, bwd = call_targets(graphs["forward"]), call_targets(graphs["backward"])
    assert "openwam._cudnn_sdpa.default" in fwd
    assert "openwam._cudnn_sdpa_backward.default" in bwd
    # The plan travels as the op's argument, not as traced aten calls.
    node = next(n for n in graphs["backward"].graph.nodes
                if str(n.target) == "openwam._cudnn_sdpa_backward.default")
    assert node.args[-1] == plan
    assert not any("scaled_dot_product" in t or "pad" in t for t in fwd + bwd)


def test_public_op_decision_is_not_traced(ow):
    """openwam::sdpa decides in C++ while torch.compile traces it: PyTorch's
    selector never lands in a graph (it broke AOTAutograd's partitioner,
    "Expected _fused_sdp_choice to be a tensor")."""
    q, k, v = qkv(2, 3, 6, 70, 16, dtype=torch.float32, requires_grad=True)
    mask = make_mask("bool", 2, 3, 6, 70)
    graphs = traced_graphs(lambda q, k, v, m: ow.sdpa(q, k, v, m), q, k, v, mask)
    everything = call_targets(graphs["forward"]) + call_targets(graphs["backward"])
    assert not any("_fused_sdp_choice" in t for t in everything)
    assert any("scaled_dot_product" in t for t in everything)  # PyTorch's own path on CPU


@pytest.mark.parametrize("backend,dynamic", [("aot_eager", False), ("aot_eager", True),
                                             ("inductor", False), ("inductor", True)])
def test_compiled_leaf_ops_match_eager(backend, dynamic):
    torch._dynamo.reset()
    (q, k, v), _, bias, _ = inputs(mask="additive")
    plan = KEY_TAIL

    def fn(q, k, v):
        return FWD(q, k, v, bias, 0.0, False, None, True, plan)[0]

    grad_out = torch.randn(q.shape)
    eager_out = fn(q, k, v)
    eager_g = torch.autograd.grad(eager_out, (q, k, v), grad_out)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    out = compiled(q, k, v)
    g = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_close(out, eager_out, 1e-6, 1e-6, "out")
    for a, b in zip(g, eager_g):
        assert_close(a, b, 1e-5, 1e-5, "grad")
    torch._dynamo.reset()


@pytest.mark.parametrize("op", ["cudnn_path", "varlen"])
def test_compiled_autograd_over_an_eager_forward(op):
    """The forward runs eagerly and the backward under compiled autograd
    (torch._dynamo.compiled_autograd), as when only the loss or the optimizer
    step is compiled: both autograd nodes give it their saved tensors
    (compiled_args) and trace their backward op (apply_with_saved). Before,
    compiled autograd raised "compiled_args not implemented"; stock F.sdpa's
    node passes. The gradients equal the eager backward's."""
    torch._dynamo.reset()
    if op == "cudnn_path":
        (q, k, v), _, bias, _ = inputs(mask="additive")

        def forward():
            return FWD(q, k, v, bias, 0.0, False, None, True, KEY_TAIL)[0]
    else:
        cu, longest = openwam_sdpa.varlen.cu_seqlens_from_lengths([3, 1, 5])
        q, k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(3))

        def forward():
            return openwam_sdpa.varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True)
    grad_out = torch.randn(forward().shape)
    forward().backward(grad_out)
    want = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = forward()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        out.backward(grad_out)
    for t, expected in zip((q, k, v), want):
        assert_close(t.grad, expected, 1e-6, 1e-6, "grad")
    torch._dynamo.reset()


# --------------------------------------------------------------------------
# The frontend's telemetry and graph cache (the op's own cuDNN graphs: CUDA only)
# --------------------------------------------------------------------------

FRONTEND_COUNTERS = ("forward_graphs_built", "backward_graphs_built", "ragged_graphs_built",
                     "graph_build_failures", "graph_cache_evictions", "aten_fallback_calls",
                     "padding_mask_backwards", "lengths_written_per_call", "score_shift_backwards")


def test_frontend_stats_count_nothing_on_the_cpu(ow):
    """The cuDNN path's leaf ops on the CPU build no graph and take no mask."""
    (q, k, v), _, bias, causal = inputs(mask="bool")
    run(q, k, v, bias, causal, KEY_TAIL, torch.randn(q.shape))
    ow.sdpa(q, k, v, is_causal=True).sum().backward()
    stats = ow.frontend_stats()
    assert set(stats) == set(FRONTEND_COUNTERS) | {"failed_configurations"}
    assert all(stats[name] == 0 for name in FRONTEND_COUNTERS), stats
    assert stats["failed_configurations"] == []
    assert ow.frontend_stats(reset=True) == stats
    ow.clear_graph_cache()  # nothing cached: a no-op, not an error
    assert ow.frontend_stats() == stats


def test_the_repair_api_is_gone(ow):
    """The dQ repair (its op, counter and threshold) is retired with its kernel:
    the frontend's padding mask fixes the defect at its source."""
    assert {"frontend_stats", "clear_graph_cache"} <= set(ow.__all__)
    for name in ("repaired_rows", "REPAIR_LSE_THRESHOLD"):
        assert name not in ow.__all__ and not hasattr(ow, name) and not hasattr(ow._C, name)
    assert not hasattr(torch.ops.openwam, "_repair_dq_")
