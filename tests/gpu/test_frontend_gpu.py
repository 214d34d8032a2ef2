"""The op's own cuDNN graphs (csrc/cudnn_frontend/) on the GPU.

The padding-mask fix swept over the matrix that found the defects, each case
held to the fuzz's accuracy rule (test_fuzz_gpu.check_case: twice the best
finite stock backend plus a floor, or twice stock as called; finite where no
stock backend is): every key length residue mod 128; head_dim 64-256, bf16
and fp16, GQA, no mask, bool, additive, left-padded (fully masked rows) and
causal masks; batch 1 with one query row; dropout. Then the ATen fallback
(OPENWAM_SDPA_FRONTEND=0), the bias corner's K/V padding, one graph build
per configuration, and what explain() and frontend_stats() say.
"""

from __future__ import annotations

import pytest
import torch

import openwam_sdpa
from support import max_err, nonfinite, run

from .conftest import GPU_MARKS, MEASURED_CUDNN, cudnn_version
from .test_fuzz_gpu import DTYPES, HEAD_DIMS, MASKS, check_case, inputs

pytestmark = GPU_MARKS


def case(**kw) -> dict:
    c = dict(dtype=torch.bfloat16, D=128, kv_heads=2, H=4, B=2, s_q=64, s_kv=320,
             layout="bhsd", mask="none", rows="all", form="spread", dropout=0.0, seed=0)
    c.update(kw)
    if c["mask"] == "left_padded":
        c["s_q"] = c["s_kv"]
    return c


# Every residue of s_kv mod 128 (the defect lives in the last, partial key tile).
RESIDUES = [case(s_kv=256 + r, seed=r) for r in range(128)]
# The matrix: a key length at residue 64 (where 9.19 fails) and one elsewhere.
MATRIX = [case(D=d, dtype=dt, mask=m, s_kv=s_kv, kv_heads=2, H=8, B=2, s_q=96,
               layout="bshd" if i % 2 else "bhsd", form="one_dim" if i % 3 else "spread",
               seed=1000 + i)
          for i, (d, dt, m, s_kv) in enumerate(
              (d, dt, m, s_kv) for d in HEAD_DIMS for dt in DTYPES for m in MASKS
              for s_kv in (320, 200 + d // 2))]
# Batch 1, one query row (cudnn-frontend #1072), with and without GQA.
SINGLE_ROW = [case(B=1, s_q=1, D=d, dtype=dt, s_kv=s_kv, kv_heads=kv, H=4, seed=2000 + i)
              for i, (d, dt, s_kv, kv) in enumerate(
                  (d, dt, s_kv, kv) for d in HEAD_DIMS for dt in DTYPES
                  for s_kv, kv in ((128, 4), (320, 1)))]
# Dropout (a multiple of 1/16, as cuDNN takes it).
DROPOUT = [case(D=d, dtype=dt, mask=m, dropout=0.125, s_q=128, seed=3000 + i)
           for i, (d, dt, m) in enumerate(
               (d, dt, m) for d in (64, 128) for dt in DTYPES for m in ("none", "causal", "bool"))]
# The bias corner where the K/V shim replaces the padding mask (few padded keys);
# the last six large enough that its backward runs in two slices, one batch
# element each (csrc/shim_slices.h: 552 key tiles a slice on the H200's 132 SMs),
# with every head and with grouped heads; an [L, S] mask is padded once for both.
BIAS_SHIM = [case(mask=m, s_kv=s_kv, s_q=32, B=1, H=2, kv_heads=1, seed=4000 + i)
             for i, (m, s_kv) in enumerate((m, s_kv) for m in ("bool", "additive")
                                           for s_kv in (2112, 4032))] + \
            [case(mask=m, s_kv=2880, s_q=256, B=2, H=24, kv_heads=kv, seed=4100 + i)
             for i, (m, kv) in enumerate((m, kv) for m in ("bool", "additive", "shared_additive")
                                         for kv in (24, 8))] + \
            [case(mask="bool", s_kv=4032, s_q=255, B=2, H=18, kv_heads=18, seed=4200),
             case(mask="bool", s_kv=4032, s_q=1, B=4, H=24, kv_heads=24, seed=4201)]
# (Found in review, the last two: two slices, the second's logsumexp rows
# 18 x 255 floats in, 8 bytes off the 16-byte boundary the graphs assume; and
# one query row, whose slices keep two batch elements, since a batch-1 slice
# with one query row is cudnn-frontend #1072's NaN in dK and dV.)


def sweep(cases, name, suite_results):
    worst, failures, admitted = {}, [], []
    for i, c in enumerate(cases):
        problem = check_case(i, c, worst, admitted)
        if problem:
            failures.append(problem)
    suite_results.put("frontend", name, cases=len(cases), failed=len(failures),
                      admitted_by_key_padded_stock=len(admitted),
                      **{f"worst {n}": [round(r, 3), i]  # (ratio, case), as the fuzz keeps it
                         for n, (r, i) in sorted(worst.items())})
    assert not failures, f"{len(failures)} of {len(cases)} failed:\n" + "\n".join(failures[:10])


def test_every_key_residue(suite_results):
    sweep(RESIDUES, "residues 256..383", suite_results)


def test_head_dims_dtypes_masks(suite_results):
    sweep(MATRIX, "head_dim x dtype x mask", suite_results)


def test_batch_one_single_query_row(suite_results):
    sweep(SINGLE_ROW, "batch 1, one query row", suite_results)


def test_single_query_row_ignores_tf32(ow):
    """The one-row backward's fp32 products stay IEEE fp32 when the user
    allows TF32 (a common training setting): the same gradients, bit for
    bit, as with TF32 off. With TF32 its ds and P would lose 13 mantissa
    bits in those products."""
    c = case(B=1, s_q=1, D=128, dtype=torch.float16, s_kv=1123, kv_heads=1, H=8, seed=2100)
    q, k, v, go, mask, causal = inputs(c)
    info = openwam_sdpa.explain(q, k, v, enable_gqa=True)
    assert "pad_query_backward" in info["plan"], info
    before = torch.backends.cuda.matmul.allow_tf32
    results = []
    try:
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            results.append(run(ow.sdpa, q, k, v, go, enable_gqa=True))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    for name in ("dq", "dk", "dv"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name


def test_dropout(suite_results):
    sweep(DROPOUT, "dropout 0.125", suite_results)


def test_bias_with_few_padded_keys(suite_results):
    sweep(BIAS_SHIM, "bias, K/V shim", suite_results)


def test_aten_fallback(settings, suite_results):
    """OPENWAM_SDPA_FRONTEND=0: ATen's cuDNN attention with padded inputs, the
    path a configuration whose graph cannot be built takes."""
    settings(frontend="0")
    c = case(mask="bool")
    q, k, v, _, mask, causal = inputs(c)
    info = openwam_sdpa.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert info["engine"] == "aten_cudnn" and info["plan"] != "none", info
    cases = [case(mask=m, seed=5000 + i) for i, m in enumerate(MASKS)]
    cases += [case(B=1, s_q=1, seed=5100), case(dropout=0.125, s_q=128, seed=5200)]
    sweep(cases, "ATen fallback", suite_results)


def test_graphs_built_once_per_configuration(ow):
    """Shapes that vary every step build each configuration's graphs once, and
    only the graphs that run. The batch-1, one-query-row shape (1, 1, 320) has
    a forward graph only: its backward is computed in fp32 without cuDNN
    (single_row_backward). The key-masked 32x2112 one takes the K/V shim: one
    backward graph, on the padded keys (none for the unpadded ones)."""
    ow.clear_graph_cache()
    ow.frontend_stats(reset=True)
    shapes = [(2, 100, 100, False), (2, 200, 320, False), (4, 64, 704, False),
              (1, 1, 320, False), (3, 333, 333, False), (1, 32, 2112, True)]
    counts = []
    for _ in range(3):
        for b, s_q, s_kv, masked in shapes:
            q = torch.randn(b, 4, s_q, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(b, 4, s_kv, 64, device="cuda", dtype=torch.bfloat16)
            keys = torch.arange(s_kv, device="cuda").view(1, 1, 1, s_kv)
            mask = keys < s_kv - 7 if masked else None
            ow.sdpa(q, kv, kv, attn_mask=mask).sum().backward()
        s = ow.frontend_stats()
        counts.append((s["forward_graphs_built"], s["backward_graphs_built"]))
    assert counts == [(6, 5)] * 3, counts
    assert ow.frontend_stats()["aten_fallback_calls"] == 0


def test_padding_mask_lengths_written_once(ow):
    """The padding mask's full lengths come from the device's table
    (lengths_table.h): a configuration writes them at its first backward,
    and later calls read them, on its stream and on another; the gradients
    stay the reference's."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, go = (torch.randn(3, 4, s, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                   for s in (77, 320, 320, 77))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert ow.explain(q, k, v)["plan"].startswith("padding_mask")
    ref = run(torch.nn.functional.scaled_dot_product_attention, q.double(), k.double(),
              v.double(), go.double())

    def check(r):
        for name in ("dq", "dk", "dv"):
            x, want = getattr(r, name), getattr(ref, name)
            err = max_err(x, want) / float(want.abs().max())
            assert err < 2e-2, (name, err)

    per_call = ow.frontend_stats()["lengths_written_per_call"]
    backwards = ow.frontend_stats()["padding_mask_backwards"]
    for _ in range(3):
        check(run(ow.sdpa, q, k, v, go))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r = run(ow.sdpa, q, k, v, go)
    torch.cuda.current_stream().wait_stream(side)
    check(r)
    stats = ow.frontend_stats()
    assert stats["padding_mask_backwards"] == backwards + 4
    assert stats["lengths_written_per_call"] == per_call


def test_explain_and_stats_name_the_engine(ow):
    c = case()
    q, k, v, go, mask, causal = inputs(c)
    info = ow.explain(q, k, v, enable_gqa=True)
    assert info["engine"] == "cudnn_frontend", info
    assert info["plan"].startswith("padding_mask"), info
    before = ow.frontend_stats()["padding_mask_backwards"]
    ours = run(ow.sdpa, q, k, v, go, enable_gqa=True)
    assert nonfinite(ours.dq) == 0
    assert ow.frontend_stats()["padding_mask_backwards"] == before + 1
    assert ow.build_info()["cudnn_frontend"] == "1.32.0"


def test_value_head_dim_of_its_own(ow, suite_results):
    """head_dim 128 for query and key, 64 for value: the frontend's graph, or
    (where cuDNN cannot build it) the ATen fallback, finite and accurate."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 4, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 2, 320, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 2, 320, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    go = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    before = ow.frontend_stats()["aten_fallback_calls"]
    ours = run(ow.sdpa, q, k, v, go, enable_gqa=True)
    ref = run(torch.nn.functional.scaled_dot_product_attention, q.double(), k.double(),
              v.double(), go.double(), enable_gqa=True)
    fell_back = ow.frontend_stats()["aten_fallback_calls"] > before
    suite_results.put("frontend", "value head_dim 64", aten_fallback=fell_back)
    for name in ("out", "dq", "dk", "dv"):
        x, r = getattr(ours, name), getattr(ref, name)
        assert nonfinite(x) == 0, name
        err = max_err(x, r) / float(r.abs().max())
        assert err < 0.05, (name, err)


@pytest.mark.parametrize("frontend", [None, "0"], ids=["frontend", "aten_fallback"])
def test_misaligned_operands(ow, settings, frontend):
    """Views whose data pointers are not 16-byte aligned (x[..., 4:68] of
    bf16 rows 72 wide: 8 bytes in) run on aligned copies: cuDNN's engines
    assume 16-byte operands, and frontend 1.32 refuses to execute on a
    misaligned pointer. Before, such a call raised INVALID_VARIANT_PACK.
    Against the float64 reference; a key length at residue 64, so the
    backward is the padding mask's (or, on the ATen fallback, the padded
    keys'); a misaligned upstream gradient too."""
    settings(frontend=frontend)
    g = torch.Generator(device="cuda").manual_seed(12)

    def view(b, h, s):
        wide = torch.randn(b, h, s, 72, device="cuda", dtype=torch.bfloat16, generator=g)
        return wide[..., 4:68]

    q, k, v, go = view(2, 4, 96), view(2, 4, 320), view(2, 4, 320), view(2, 4, 96)
    mask = torch.randn(2, 1, 96, 328, device="cuda", dtype=torch.bfloat16,
                       generator=g)[..., 1:321]  # additive, 2 bytes in, rows 656 bytes apart
    for t in (q, k, v, go, mask):
        assert t.data_ptr() % 16 != 0
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    for kw in ({}, {"attn_mask": mask}):
        ours = run(ow.sdpa, q, k, v, go, **kw)
        ref = run(torch.nn.functional.scaled_dot_product_attention, q.double(), k.double(),
                  v.double(), go.double(), **{n: m.double() for n, m in kw.items()})
        for name in ("out", "dq", "dk", "dv"):
            x, r = getattr(ours, name), getattr(ref, name)
            err = max_err(x, r) / float(r.abs().max())
            assert err < 2e-2, (sorted(kw), name, err)


@pytest.mark.parametrize("s_kv", [256, 320], ids=["stock_graph", "padding_mask"])
def test_slices_of_a_packed_qkv_projection(ow, s_kv):
    """q, k and v as a fused projection gives them: [B, S, 3, H, D] unbound and
    transposed, so no operand is dense and each gradient is laid out apart
    from its input (at::empty_like's rule). The ragged engine's backward got
    dQ wrong on such views (cuDNN 9.19.0); the dense graphs, which describe
    every tensor's strides whole, must not. Against the float64 reference, at
    a key length with no fix and one with the padding mask."""
    g = torch.Generator(device="cuda").manual_seed(15)
    b, h, s_q = 2, 4, 96
    q = torch.randn(b, s_q, 3, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)[:, :, 0]
    kv = torch.randn(b, s_kv, 3, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, kv[:, :, 1], kv[:, :, 2]))
    assert not q.is_contiguous() and q.stride(2) == 3 * h * 64
    go = torch.randn(b, h, s_q, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    info = ow.explain(q, k, v)
    assert info["engine"] == "cudnn_frontend", info
    assert info["plan"].startswith("padding_mask") == (s_kv % 128 == 64), info
    ours = run(ow.sdpa, q, k, v, go)
    ref = run(torch.nn.functional.scaled_dot_product_attention, q.double(), k.double(),
              v.double(), go.double())
    for name in ("out", "dq", "dk", "dv"):
        x, r = getattr(ours, name), getattr(ref, name)
        err = max_err(x, r) / float(r.abs().max())
        assert err < 2e-2, (name, err)


@pytest.mark.parametrize("masked", [False, True], ids=["padding_mask", "shift_scores"])
def test_dropout_pattern_shared_by_forward_and_backward(ow, masked):
    """With value = identity (64 keys, head_dim 64), the output is the dropped
    probability matrix itself, so the backward's dV must be out^T @ dO
    exactly when the backward replays the forward's dropout pattern. The key
    length is at residue 64: without a mask the backward runs with the
    padding mask (and, since this check, the forward too); with a bool mask
    (every key kept) on shifted scores."""
    g = torch.Generator(device="cuda").manual_seed(14)
    b, h, s_q, s_kv = 2, 4, 96, 64
    q = torch.randn(b, h, s_q, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, h, s_kv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.eye(64, device="cuda", dtype=torch.bfloat16).expand(b, h, 64, 64).contiguous()
    v.requires_grad_()
    mask = torch.ones(b, 1, s_q, s_kv, device="cuda", dtype=torch.bool) if masked else None
    info = ow.explain(q, k, v.detach().requires_grad_(), attn_mask=mask, dropout_p=0.25)
    plan = "shift_scores" if masked and cudnn_version() == MEASURED_CUDNN else "padding_mask"
    assert info["engine"] == "cudnn_frontend" and info["plan"].startswith(plan), info
    go = torch.randn(b, h, s_q, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out = ow.sdpa(q, k, v, attn_mask=mask, dropout_p=0.25)
    (dv,) = torch.autograd.grad(out, (v,), go)
    dropped = (out == 0).float().mean().item()
    assert 0.15 < dropped < 0.35, dropped  # the pattern is a dropout's
    want = out.double().transpose(-2, -1) @ go.double()
    err = max_err(dv, want) / float(want.abs().max())
    assert err < 2e-2, err
