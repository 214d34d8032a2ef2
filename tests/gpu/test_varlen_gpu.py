"""sdpa_varlen on CUDA: every engine against F.sdpa applied to each sequence
alone (float64), adversarial rows per sequence, CUDA graphs, autocast,
torch.compile, explain_varlen, graph builds per batch, and the cuDNN
ragged-layout sweep that admits the default engine.

Engines: "cudnn" (cuDNN's ragged layout on the frontend's graphs, the default
where the guard table lets it run), "flash" (ATen's FlashAttention-2 varlen)
and "block_diagonal" (openwam::sdpa over the packed batch with a
block-diagonal mask), all in this process; tools/sweep_varlen_ragged.py runs
each sweep cell in a child process with a timeout (ATen's own ragged call hung
there with one query per sequence; the frontend's graph must not).

The error rule is the suite's (support.twice_stock_problem): against the
float64 reference, at most twice the error of stock F.sdpa on the padded
batch (efficient attention with a key-padding mask: finite where stock cuDNN
is not) plus the floor of the case's dtype. "Fully masked" rows do not exist
in varlen (there is no mask); the nearest thing, query rows of a sequence
without keys (and its mirror, keys without queries), is
test_sequence_with_one_side_empty (zero output, zero gradient, as F.sdpa per
sequence gives). test_varlen_fuzz_gpu.py holds the fuzz.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import openwam_sdpa
from support import (assert_same_draw, load_tool, max_err, nonfinite, run_by_backward,
                     tool_path, twice_stock_problem)

from .conftest import GPU_MARKS, LOW_ROW_FLOOR, cudnn_version, floor_for

pytestmark = GPU_MARKS

sweep = load_tool("sweep_varlen_ragged.py")
DTYPE = torch.bfloat16
IN_PROCESS_ENGINES = ("cudnn", "flash", "block_diagonal")
BACKEND = {"cudnn": "cudnn_ragged", "flash": "flash_varlen", "block_diagonal": "block_diagonal"}
# A sweep cell takes seconds (the import, then a few forward+backward); a
# cell past this is recorded as a hang. Ten cells: at most ten minutes.
SWEEP_CELL_TIMEOUT_S = 60


@pytest.fixture
def engine_setting(monkeypatch):
    def apply(engine):
        monkeypatch.setenv("OPENWAM_SDPA_VARLEN", engine)
        openwam_sdpa.varlen_settings(reload=True)

    yield apply
    monkeypatch.delenv("OPENWAM_SDPA_VARLEN", raising=False)
    openwam_sdpa.varlen_settings(reload=True)


def run_public(p, engine_setting, engine, is_causal):
    engine_setting(engine)
    enable_gqa = p.q.shape[1] != p.k.shape[1]
    e = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                    is_causal=is_causal, enable_gqa=enable_gqa)
    out = openwam_sdpa.varlen_sdpa(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                   is_causal=is_causal, enable_gqa=enable_gqa)
    return sweep._grads(out, p), e["backend"]


def rule_problems(ours, stock, ref, rows=(), dtype=DTYPE):
    """The error rule on out, dQ, dK, dV (max norm, the adversarial dQ rows
    left out and checked by their relative error as the suite does)."""
    problems = []
    for n in sweep.Attn._fields:
        x, s, r = getattr(ours, n), getattr(stock, n), getattr(ref, n)
        skip = list(rows) if n in ("out", "dq") else None
        problems.append(twice_stock_problem(n, sweep.max_err(x, r, skip),
                                            sweep.max_err(s, r, skip), floor_for(r, dtype)))
    if rows:
        problems.append(twice_stock_problem(
            "adversarial dQ rows (relative error)", sweep.row_rel_err(ours.dq, ref.dq, rows),
            sweep.row_rel_err(stock.dq, ref.dq, rows), LOW_ROW_FLOOR))
    return [p for p in problems if p]


CASES = {
    # name: (lens_q, lens_k, kwargs of packed_adversarial, is_causal)
    "mixed_with_length_1": ([37, 1, 200, 3, 129], None, dict(D=128, low="none"), False),
    "causal_square": ([37, 1, 200, 3, 129], None, dict(D=128, low="none"), True),
    "gqa_causal": ([64, 1, 300], None, dict(D=128, H=8, Hkv=2, low="none"), True),
    "head_dim_64": ([100, 17, 5], None, dict(D=64, low="none"), True),
    "head_dim_256": ([100, 17, 5], None, dict(D=256, low="none"), True),
    "cross_attention": ([10, 1, 77], [90, 33, 4], dict(D=128, low="none"), False),
    "cross_attention_causal": ([10, 1, 77], [90, 33, 4], dict(D=128, low="none"), True),
    # Adversarial: one row per sequence with logsumexp about -115, in
    # sequences of 64 mod 128 tokens (the key-tail defect's lengths).
    "adversarial_key_tail": ([192, 320, 448, 576], None, dict(D=128), False),
    "adversarial_key_tail_causal": ([192, 320, 448, 576], None, dict(D=128), True),
    "adversarial_one_query_rows": ([1, 1, 1], [64, 192, 320], dict(D=128, low="first"), False),
    "adversarial_batch1_one_query": ([1], [192], dict(D=128, low="first"), False),
    "adversarial_gqa_fp16_d256": ([192, 1, 320], None,
                                  dict(D=256, H=8, Hkv=2, dtype=torch.float16), True),
    "adversarial_d192_cross": ([64, 7, 1], [320, 448, 64], dict(D=192), False),
    "empty_sequences_causal": ([5, 0, 9, 0, 1], None, dict(D=64, low="none"), True),
}


@pytest.mark.parametrize("engine", IN_PROCESS_ENGINES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_engine_within_twice_padded_stock(case, engine, engine_setting, suite_results):
    from torch.nn.attention import SDPBackend

    lens_q, lens_k, make, causal = case
    p = sweep.packed_adversarial(lens_q, lens_k, **make)
    ref = sweep.reference(p, causal)
    stock = sweep.padded_stock(p, causal, SDPBackend.EFFICIENT_ATTENTION)
    assert stock is not None, "stock efficient attention refused the padded batch"
    ours, backend = run_public(p, engine_setting, engine, causal)
    stock_cudnn = sweep.padded_stock(p, causal, SDPBackend.CUDNN_ATTENTION)
    dtype = make.get("dtype", DTYPE)
    name = next(k for k, v in CASES.items() if v is case)
    suite_results.put("varlen engines", f"{name} {engine}", backend=backend,
                      nonfinite=sum(nonfinite(t) for t in ours),
                      stock_padded_cudnn_nonfinite=None if stock_cudnn is None
                      else sum(nonfinite(t) for t in stock_cudnn),
                      err_dq=f"{max_err(ours.dq, ref.dq):.3e}",
                      stock_err_dq=f"{max_err(stock.dq, ref.dq):.3e}")
    if engine == "flash" and causal and lens_k is not None:
        # Distinct cu_seqlens with is_causal: FlashAttention-2 would align
        # bottom-right, so the op takes the fallback.
        assert backend == "block_diagonal"
    else:
        assert backend == BACKEND[engine]
    assert sum(nonfinite(t) for t in ours) == 0
    problems = rule_problems(ours, stock, ref, p.low_rows, dtype)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("engine", IN_PROCESS_ENGINES)
@pytest.mark.parametrize("lens_q, lens_k, rows, zero", [
    ([3, 4, 2], [5, 0, 7], slice(3, 7), ("out", "dq")),  # queries, no keys
    ([3, 0, 2], [5, 4, 7], slice(5, 9), ("dk", "dv")),   # keys, no queries
], ids=["queries_without_keys", "keys_without_queries"])
def test_sequence_with_one_side_empty(lens_q, lens_k, rows, zero, engine, engine_setting):
    """A sequence with queries but no keys gets zero output and dQ; one with
    keys but no queries zero dK and dV (F.sdpa on that sequence alone), not
    whatever the buffers held (the second call reuses the first's freed
    memory). No NaN anywhere, and the other sequences within twice stock's
    error (efficient attention on each sequence alone)."""
    p = sweep.packed_adversarial(lens_q, lens_k, D=64, low="none")
    for _ in range(2):
        ours, _ = run_public(p, engine_setting, engine, False)
    ref = sweep.reference(p, False)
    stock = sweep.reference(p, False, stock=True)
    assert sum(nonfinite(t) for t in ours) == 0
    for n in zero:
        t = getattr(ours, n)[rows]
        assert torch.equal(t, torch.zeros_like(t)), n
    for n in sweep.Attn._fields:
        r = getattr(ref, n)
        assert max_err(getattr(ours, n), r) <= \
            2 * max_err(getattr(stock, n), r) + floor_for(r, DTYPE), n


def test_head_dims_the_fuzz_did_not_pass_leave_the_ragged_engine(engine_setting):
    """Guard row ragged_adversarial_dq_9.19: on 9.19.0 the ragged engine is
    the default at head_dim 64, 128 and 256 only (at 192 the varlen fuzz found
    an adversarial row's dQ 5.4x stock's); OPENWAM_SDPA_VARLEN=cudnn still
    selects it, and where FlashAttention-2 cannot serve it stays."""
    p = sweep.packed_adversarial([1, 34, 0, 85], None, D=192, low="none")  # degenerate too
    args = (p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k)
    e = openwam_sdpa.explain_varlen(*args, is_causal=True)
    if cudnn_version() != 91900:
        assert e["rule"] == "ragged_unmeasured", e
        return
    assert e["backend"] == "flash_varlen" and e["rule"] == "ragged_adversarial_dq_9.19", e
    distinct = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k.clone(), p.max_q,
                                           p.max_k, is_causal=True)
    assert distinct["backend"] == "cudnn_ragged", distinct  # not the O(total^2) fallback
    engine_setting("cudnn")
    e = openwam_sdpa.explain_varlen(*args, is_causal=True)
    assert e["backend"] == "cudnn_ragged", e
    assert e["rule"] == "ragged_adversarial_dq_9.19 (overridden by OPENWAM_SDPA_VARLEN=cudnn)"


def test_empty_sequences_flash(engine_setting):
    """Sequences of length 0 in cu_seqlens (repeated offsets): FlashAttention-2
    skips them; the rest is exact to bf16."""
    p = sweep.packed_adversarial([5, 0, 9, 0], None, D=64, low="none")
    ours, backend = run_public(p, engine_setting, "flash", True)
    assert backend == "flash_varlen"
    ref = sweep.reference(p, True)
    assert sum(nonfinite(t) for t in ours) == 0
    for n in sweep.Attn._fields:
        assert max_err(getattr(ours, n), getattr(ref, n)) <= \
            8 * floor_for(getattr(ref, n), DTYPE) + 1e-3, n


def test_explain_on_cuda(engine_setting):
    p = sweep.packed_adversarial([16, 8], None, D=64, low="none")
    e = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                    is_causal=True)
    if cudnn_version() == 91900:  # measured right there: the default
        assert e["backend"] == "cudnn_ragged" and e["rule"] == "", e
    else:
        assert e["backend"] == "flash_varlen" and e["rule"] == "ragged_unmeasured", e
    e = openwam_sdpa.explain_varlen(p.q.float(), p.k.float(), p.v.float(), p.cu_q, p.cu_k,
                                    p.max_q, p.max_k)
    assert e["backend"] == "block_diagonal"
    engine_setting("flash")
    e = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_q.clone(), p.max_q, p.max_k,
                                    is_causal=True)
    assert e["backend"] == "block_diagonal" and "not one tensor" in e["flash_rejects"]
    engine_setting("cudnn")
    e = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k)
    assert e["backend"] == "cudnn_ragged", e
    if cudnn_version() != 91900:
        assert e["rule"] == "ragged_unmeasured (overridden by OPENWAM_SDPA_VARLEN=cudnn)"


def test_graph_builds_over_200_lognormal_batches(engine_setting, suite_results):
    """A training run whose batches differ in sequence count and lengths
    (lognormal, mu ln 256, sigma 0.9, about 4,096 tokens a batch) builds each
    bucketed configuration's graphs once, not a graph per step: a forward
    graph per (sequences, longest) bucket, a backward graph per (sequences,
    longest, total tokens) bucket."""
    import math
    import random

    engine_setting("cudnn")
    openwam_sdpa.clear_graph_cache()
    openwam_sdpa.frontend_stats(reset=True)
    rng = random.Random(3)
    forwards, backwards, builds = set(), set(), []
    for step in range(200):
        lens = []
        while sum(lens) < 4096:
            lens.append(max(16, min(2048, int(math.exp(rng.gauss(math.log(256), 0.9))))))
        total, longest, n = sum(lens), max(lens), len(lens)
        bucket = lambda x, lo: max(lo, 1 << (x - 1).bit_length())  # ragged_buckets.h
        forwards.add((bucket(n, 1), bucket(longest, 64)))
        backwards.add((bucket(n, 1), bucket(longest, 64), bucket(total, 64)))
        q = torch.randn(total, 4, 64, device="cuda", dtype=DTYPE, requires_grad=True)
        cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)),
                          device="cuda", dtype=torch.int32)
        openwam_sdpa.varlen_sdpa(q, q, q, cu, cu, longest, longest, is_causal=True).sum().backward()
        builds.append(openwam_sdpa.frontend_stats()["ragged_graphs_built"])
    suite_results.put("varlen graph builds", "200 lognormal batches",
                      configurations=len(backwards), graphs_built=builds[-1],
                      built_in_last_100_steps=builds[-1] - builds[99])
    assert builds[-1] == len(forwards) + len(backwards), (builds[-1], sorted(backwards))
    assert len(backwards) <= 12, sorted(backwards)


def test_head_major_batches_share_their_bucket(engine_setting):
    """Head-major buffers ([H, total, E] seen as [total, H, E], as transformers'
    packed layers hand them over) of three totals in one bucket build one
    forward and one backward graph. The forward had taken their head stride,
    the total, into the graph: a graph per batch (found in review)."""
    engine_setting("cudnn")
    openwam_sdpa.clear_graph_cache()
    openwam_sdpa.frontend_stats(reset=True)
    g = torch.Generator(device="cuda").manual_seed(17)
    for last in (69, 80, 100):  # totals 269, 280, 300: 3 sequences, longest 100
        lengths = [100, 100, last]
        total = sum(lengths)
        q, k, v = (torch.randn(4, total, 64, device="cuda", dtype=DTYPE, generator=g)
                   .transpose(0, 1).requires_grad_() for _ in range(3))
        cu = torch.tensor([0, 100, 200, total], device="cuda", dtype=torch.int32)
        openwam_sdpa.varlen_sdpa(q, k, v, cu, cu, 100, 100, is_causal=True).sum().backward()
    assert openwam_sdpa.frontend_stats()["ragged_graphs_built"] == 2


@pytest.mark.parametrize("engine", IN_PROCESS_ENGINES)
def test_activation_checkpointing(engine, engine_setting):
    """Non-reentrant torch.utils.checkpoint recomputes the forward inside the
    op's backward node; the gradients equal the uncheckpointed call's within
    the suite's rule (adversarial rows and 64 mod 128 lengths)."""
    from torch.utils.checkpoint import checkpoint

    p = sweep.packed_adversarial([192, 1, 320], None, D=128)
    engine_setting(engine)

    def call(q, k, v):
        return openwam_sdpa.varlen_sdpa(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                        is_causal=True)

    plain = sweep._grads(call(p.q, p.k, p.v), p)
    ours = sweep._grads(checkpoint(call, p.q, p.k, p.v, use_reentrant=False), p)
    assert not rule_problems(ours, plain, sweep.reference(p, True), rows=p.low_rows)


@pytest.mark.parametrize("engine", ["cudnn", "flash"])
def test_reentrant_checkpointing_with_dropout_draws_the_same_pattern(engine, engine_setting):
    """Reentrant checkpointing runs the forward under no_grad and recomputes
    it with grad from the same RNG state. A call with dropout runs the
    training graph whatever the grad mode (not cuDNN's inference graph), so
    both draw the same pattern: the output bit for bit, the gradients up to
    the atomic dQ accumulation."""
    from torch.utils.checkpoint import checkpoint

    p = sweep.packed_adversarial([192, 37, 320], None, D=128, low="none")
    engine_setting(engine)

    def call(q, k, v):
        return openwam_sdpa.varlen_sdpa(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                        is_causal=True, dropout_p=0.3)

    torch.manual_seed(7)
    plain = run_by_backward(call, p.q, p.k, p.v, p.go)
    torch.manual_seed(7)
    ckpt = run_by_backward(lambda *xs: checkpoint(call, *xs, use_reentrant=True),
                           p.q, p.k, p.v, p.go)
    assert_same_draw(ckpt, plain)


@pytest.mark.parametrize("engine", ["cudnn", "flash"])
def test_no_host_sync_and_cuda_graph(engine, engine_setting):
    """The fused engines' forward and backward capture into a CUDA graph
    (a host sync inside would fail the capture) and replay to eager's result.
    Eager runs after the capture: a backward on the legacy default stream
    first would tie the leaves' gradient accumulators to that stream, and the
    capture would fail for any op (PyTorch's CUDA-graph notes: warm up on a
    side stream). Eager takes leaves of its own for the same reason: the
    captured leaves' gradient accumulators belong to the side stream."""
    p = sweep.packed_adversarial([37, 1, 200, 3], None, D=128, low="none")
    engine_setting(engine)

    def step(q=p.q, k=p.k, v=p.v):
        out = openwam_sdpa.varlen_sdpa(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                       is_causal=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), p.go)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    eager = step(*(t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)))
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def test_autocast_runs_in_bfloat16_on_flash(engine_setting):
    engine_setting("flash")
    p = sweep.packed_adversarial([37, 1, 200], None, D=128, low="none", dtype=torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = openwam_sdpa.varlen_sdpa(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                       is_causal=True)
    assert out.dtype == torch.bfloat16
    ref = sweep.reference(p, True)
    assert max_err(out, ref.out) <= 8 * floor_for(ref.out, torch.bfloat16) + 1e-2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            openwam_sdpa.varlen_sdpa(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                     is_causal=True).float().sum().backward()
    keys = {e.key for e in prof.key_averages()}
    assert "aten::_flash_attention_forward" in keys and "aten::_flash_attention_backward" in keys


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_dynamic_one_graph_for_every_batch(backend):
    torch._dynamo.reset()
    frames = []

    def fn(q, k, v, cu, max_len):
        return openwam_sdpa.varlen_sdpa(q, k, v, cu, cu, max_len, max_len, is_causal=True)

    compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
    from torch._dynamo.utils import counters

    counters.clear()
    for lens in ([37, 1, 200, 3], [64, 129, 7], [500, 12, 2, 2, 90]):
        p = sweep.packed_adversarial(lens, None, D=128, low="none")
        out = compiled(p.q, p.k, p.v, p.cu_q, p.max_q)
        got = sweep._grads(out, p)
        ref = sweep.reference(p, True)
        for n in sweep.Attn._fields:
            assert max_err(getattr(got, n), getattr(ref, n)) <= \
                8 * floor_for(getattr(ref, n), DTYPE) + 1e-3, (lens, n)
        frames.append(counters["stats"]["unique_graphs"])
    assert frames[-1] == frames[0] == 1, f"graphs compiled after each batch: {frames}"
    torch._dynamo.reset()


@pytest.mark.parametrize("compute_log_sumexp", [True, False])
@pytest.mark.parametrize("engine", ["flash", "cudnn"])
def test_opcheck_fused_leaf(engine, compute_log_sumexp):
    p = sweep.packed_adversarial([37, 1, 64], None, D=64, low="none")
    args = (p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, True, None,
            sweep.ENGINE_BITS[engine], compute_log_sumexp)
    if not compute_log_sumexp:
        args = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(torch.ops.openwam._sdpa_varlen.default, args)


@pytest.mark.parametrize("is_causal", [False, True])
def test_inference_builds_no_backward_graph(is_causal, engine_setting):
    """A call nothing will differentiate runs cuDNN's inference graph: no
    statistics written, no backward graph prepared, and the training call's
    output (adversarial rows and a key tail included)."""
    engine_setting("cudnn")
    p = sweep.packed_adversarial([192, 1, 320, 7], None, D=128)
    args = (p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k)
    openwam_sdpa.clear_graph_cache()
    openwam_sdpa.frontend_stats(reset=True)
    with torch.no_grad():
        out = openwam_sdpa.varlen_sdpa(*args, is_causal=is_causal)
        _, lse, _, _ = torch.ops.openwam._sdpa_varlen(*args, 0.0, is_causal, None,
                                                      sweep.ENGINE_BITS["cudnn"], False)
    assert lse.numel() == 0
    assert openwam_sdpa.frontend_stats()["ragged_graphs_built"] == 1  # the forward alone
    trained = sweep._grads(openwam_sdpa.varlen_sdpa(*args, is_causal=is_causal), p)
    stats = openwam_sdpa.frontend_stats()
    assert stats["ragged_graphs_built"] == 3 and stats["graph_build_failures"] == 0, stats
    assert nonfinite(out) == 0
    ref = sweep.reference(p, is_causal)
    # The inference graph's output against the training graph's: the same
    # attention, within the rounding of one element.
    assert max_err(out, trained.out) <= floor_for(ref.out, DTYPE) * 4
    assert max_err(out, ref.out) <= 2 * max_err(trained.out, ref.out) + floor_for(ref.out, DTYPE)


@pytest.mark.parametrize("cell", list(sweep.CELLS))
def test_cudnn_ragged_sweep(cell, suite_results):
    """The sweep that admits the ragged engine: per cell, in a child process
    with a timeout (ATen's ragged call hung at s_q == 1), cuDNN's ragged
    layout and FlashAttention-2 run the leaf op; both must finish, and be
    finite where stock cuDNN on the padded batch was not. Errors and times go
    to gpu_suite_results (section "varlen cuDNN ragged sweep") and
    $OUT/varlen_ragged_sweep/<cell>.json; the accuracy rule on the same
    kinds of batches is test_engine_within_twice_padded_stock's."""
    cmd = [sys.executable, tool_path("sweep_varlen_ragged.py"), "--cells", cell,
           "--engines", "flash,cudnn"]  # flash first: a cuDNN hang leaves its row
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SWEEP_CELL_TIMEOUT_S)
        stdout = done.stdout
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}: " + \
            (done.stderr.strip().splitlines() or [""])[-1][:200]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timeout after {SWEEP_CELL_TIMEOUT_S} s (hang)"
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(os.path.join(out_dir, "varlen_ragged_sweep"), exist_ok=True)
        with open(os.path.join(out_dir, "varlen_ragged_sweep", f"{cell}.json"), "w") as f:
            json.dump({"status": status, "rows": rows}, f, indent=1)
    for row in rows:
        suite_results.put("varlen cuDNN ragged sweep", f"{cell} {row['engine']}", status=status,
                          **{k: row.get(k) for k in (
                              "error", "nonfinite_out", "nonfinite_dq", "nonfinite_dk",
                              "nonfinite_dv", "err_dq", "stock_padded_efficient_err_dq",
                              "low_rows_rel_err_dq", "stock_padded_cudnn_nonfinite_dq",
                              "ms_fwd_bwd")})
    if not any(r["engine"] == "cudnn" for r in rows):
        suite_results.put("varlen cuDNN ragged sweep", f"{cell} cudnn", status=status)
    flash = [r for r in rows if r["engine"] == "flash"]
    assert flash, f"no FlashAttention-2 row: {status}"
    assert "error" not in flash[0], flash[0]
    assert sum(flash[0][f"nonfinite_{n}"] for n in sweep.Attn._fields) == 0, flash[0]
    cudnn = [r for r in rows if r["engine"] == "cudnn"]
    assert cudnn, f"no cuDNN row: {status}"
    assert "error" not in cudnn[0], cudnn[0]
    assert sum(cudnn[0][f"nonfinite_{n}"] for n in sweep.Attn._fields) == 0, cudnn[0]


def packed_views(layout, total, g):
    """q, k, v [total, 4, 64] bf16 as a model may hand them to varlen_sdpa."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    if layout == "misaligned":  # each starts 8 bytes into its buffer (rows 144 bytes apart)
        return tuple(randn(total, 4, 72)[..., 4:68] for _ in range(3))
    if layout == "narrow_rows":  # an aligned start, rows 136 bytes apart (run on a copy)
        return tuple(randn(total, 4, 68)[..., :64] for _ in range(3))
    if layout == "qkv_packed":  # one projection's output: rows 3 * 4 * 64 apart
        qkv = randn(total, 3, 4, 64)
        return qkv[:, 0], qkv[:, 1], qkv[:, 2]
    # head-major buffers: a head's rows adjacent, heads total * 64 apart
    return tuple(randn(4, total, 64).transpose(0, 1) for _ in range(3))


@pytest.mark.parametrize("layout", ["misaligned", "narrow_rows", "qkv_packed", "head_major"])
@pytest.mark.parametrize("engine", ["cudnn", "flash"])
def test_strided_and_misaligned_operands(engine, layout, engine_setting):
    """Both fused engines on packed inputs that are views: misaligned starts or
    rows (run on aligned copies: frontend 1.32 refused them, FlashAttention-2
    loads 16-byte vectors), slices of a packed qkv projection and head-major
    buffers (the ragged forward takes a slice's strides as they are and copies
    head-major buffers into rows; its backward, which got dQ wrong on both on
    cuDNN 9.19.0, runs on contiguous copies);
    each sequence against F.sdpa on it alone in float64."""
    engine_setting(engine)
    ow = openwam_sdpa
    g = torch.Generator(device="cuda").manual_seed(13)
    lengths = [77, 128, 64]
    total, cu = sum(lengths), torch.tensor([0, 77, 205, 269], device="cuda", dtype=torch.int32)
    q, k, v = (t.detach().requires_grad_() for t in packed_views(layout, total, g))
    if layout == "misaligned":
        assert q.data_ptr() % 16 != 0
    info = ow.explain_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    assert info["backend"] == BACKEND[engine], info
    out = ow.varlen_sdpa(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    go = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        start += n
        qs, ks, vs = (t[rows].detach().double().transpose(0, 1).requires_grad_()
                      for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        rq, rk, rv = torch.autograd.grad(ref, (qs, ks, vs), go[rows].double().transpose(0, 1))
        for name, x, r in (("out", out[rows], ref), ("dq", dq[rows], rq), ("dk", dk[rows], rk),
                           ("dv", dv[rows], rv)):
            err = max_err(x.transpose(0, 1), r) / float(r.abs().max())
            assert err < 2e-2, (info["backend"], n, name, err)
