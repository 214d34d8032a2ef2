"""The dQ-row repair kernel on its own (torch.ops.openwam._repair_dq_,
csrc/cuda/repair/), and its telemetry through openwam_sdpa.repaired_rows().

Inputs come from openwam_sdpa.adversarial (rows with a logsumexp far below
the repair threshold). The repair is fed the float64 reference's output and
logsumexp (what any forward gives, up to rounding) and a dQ whose rows to
keep hold finite sentinels and whose rows to write hold NaN. Then:

* rows with a finite logsumexp below -40 are within the error rule: max
  error against float64 at most twice the worse of PyTorch's flash and
  efficient backends' dQ error on the same rows (plus a quarter ulp of the
  largest entry);
* rows with logsumexp -inf are zeros; every other row is bit-identical;
* nothing is non-finite.

Covered: bf16 and fp16; head_dim 64, 72, 128, 256; GQA; is_causal; bias
broadcast as [B,1,1,S], [1,1,Sq,S], [B,H,Sq,S] (with fully masked rows);
BSHD views; rows not 16-byte aligned (the kernel's element-load path);
s_kv 64, 192, 704; affected shares none, one row per (b, h), 10%, all;
CUDA-graph capture and replay; stock cuDNN's own NaN dQ repaired.
"""

from __future__ import annotations

import math
import subprocess
import sys
import zlib
from typing import NamedTuple, Optional

import pytest
import torch

import openwam_sdpa

from .conftest import (
    GPU_MARKS,
    SDPBackend,
    floor_for,
    reference,
    run_stock,
)

pytestmark = GPU_MARKS

THRESHOLD = openwam_sdpa.REPAIR_LSE_THRESHOLD  # kRepairLseThreshold (csrc/repair_dq.h)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Case(NamedTuple):
    dtype: str = "bf16"
    D: int = 128
    s_q: int = 128
    s_kv: int = 704
    rows: object = 0.1
    H: int = 4
    kv_heads: Optional[int] = None
    layout: str = "bhsd"  # or "bshd", or "padded": rows D + 3 elements apart
    causal: bool = False
    bias: Optional[str] = None  # "key" [B,1,1,S], "rows" [1,1,Sq,S], "full" [B,H,Sq,S]
    masked_rows: tuple = ()  # query rows whose every key the bias hides
    B: int = 2

    @property
    def id(self) -> str:
        parts = [self.dtype, f"d{self.D}", f"{self.s_q}x{self.s_kv}", f"rows-{self.rows}"]
        if self.kv_heads:
            parts.append(f"gqa{self.H}-{self.kv_heads}")
        if self.layout != "bhsd":
            parts.append(self.layout)
        if self.causal:
            parts.append("causal")
        if self.bias:
            parts.append(f"bias-{self.bias}")
        if self.masked_rows:
            parts.append("masked-rows")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode()) % 10_000


SHARES = ("none", "one_per_head", 0.1, "all")
CASES = (
    [Case(rows=r) for r in SHARES]
    + [Case(dtype="fp16", rows=r) for r in SHARES[1:]]
    + [Case(D=d, s_kv=192, rows=r) for d in (64, 72, 256) for r in ("one_per_head", "all")]
    + [Case(s_kv=s, rows=0.1) for s in (64, 192)]
    + [
        Case(s_q=200, s_kv=192, rows=0.1, H=8, kv_heads=2),
        Case(s_q=192, s_kv=192, rows="all", causal=True),
        Case(dtype="fp16", s_q=130, s_kv=704, rows=0.1, causal=True, D=64),
        Case(s_kv=192, rows=0.1, bias="key"),
        Case(s_kv=704, rows="one_per_head", bias="rows", masked_rows=(0, 77)),
        Case(s_kv=192, rows=0.1, bias="full", masked_rows=(5, 6, 100)),
        Case(s_kv=704, rows=0.1, layout="bshd"),
        Case(dtype="fp16", s_kv=192, rows="all", layout="bshd", bias="key"),
        Case(s_q=70, s_kv=77, D=72, rows=0.1, layout="padded", bias="full", masked_rows=(3,)),
        # Keys long enough that a head's narrow tile is split across a
        # cluster of two blocks (kSplitMinKeyBlocks, csrc/cuda/repair/layout.cuh),
        # at each head_dim width; fp16 keeps whole tiles, taken in turn.
        Case(s_kv=1600, rows="one_per_head"),
        Case(s_kv=1600, rows="one_per_head", D=64, layout="bshd", bias="key"),
        Case(s_kv=1600, rows="one_per_head", D=256),
        Case(s_q=1600, s_kv=1600, rows=0.005, causal=True, H=2),
        Case(dtype="fp16", s_kv=1600, rows="one_per_head"),
    ]
)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """BHSD contiguous, BSHD storage viewed as BHSD, or rows D + 3 elements
    apart starting one element in (not 16-byte aligned)."""
    if layout == "bhsd":
        return t.contiguous()
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    B, H, S, D = t.shape
    buf = torch.zeros(B, H, S, D + 3, dtype=t.dtype, device=t.device)
    view = buf[..., 1:1 + D]
    view.copy_(t)
    return view


def _bias(case: Case, dtype, device) -> Optional[torch.Tensor]:
    """Additive bias in q's dtype: 0.5 N(0, 1) where visible, -inf on ~20% of
    keys (never all of a row, except case.masked_rows)."""
    if case.bias is None:
        return None
    B, H, s_q, s_kv = case.B, case.H, case.s_q, case.s_kv
    shape = {"key": (B, 1, 1, s_kv), "rows": (1, 1, s_q, s_kv),
             "full": (B, H, s_q, s_kv)}[case.bias]
    g = torch.Generator().manual_seed(case.seed + 1)
    visible = torch.rand(shape, generator=g) < 0.8
    anchor = torch.randint(0, s_kv, shape[:-1] + (1,), generator=g)
    visible.scatter_(-1, anchor, True)
    for r in case.masked_rows:
        visible[..., r, :] = False
    bias = (0.5 * torch.randn(shape, generator=g)).masked_fill(~visible, float("-inf"))
    return bias.to(device=device, dtype=dtype)


class Prepared(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    go: torch.Tensor
    bias: Optional[torch.Tensor]
    out: torch.Tensor  # reference output, in the inputs' dtype and layout
    lse: torch.Tensor  # reference logsumexp, float32 [B, H, s_q, 1]
    ref_dq: torch.Tensor  # float64
    scale: float


def _prepare(case: Case) -> Prepared:
    from openwam_sdpa.adversarial import adversarial_inputs

    dtype = DTYPES[case.dtype]
    base_layout = "bshd" if case.layout == "bshd" else "bhsd"
    q, k, v, go, _ = adversarial_inputs(
        case.B, case.H, case.s_q, case.s_kv, case.D, rows=case.rows, kv_heads=case.kv_heads,
        layout=base_layout, dtype=dtype, device="cuda", seed=case.seed)
    if case.layout == "padded":
        q, k, v, go = (_layout(t, "padded") for t in (q, k, v, go))
    bias = _bias(case, dtype, q.device)
    gqa = case.kv_heads is not None
    ref, lse = reference(q, k, v, go, attn_mask=bias, is_causal=case.causal, enable_gqa=gqa)
    out = _layout(ref.out.to(dtype), case.layout)
    lse = lse.float().unsqueeze(-1).contiguous()
    return Prepared(q, k, v, go, bias, out, lse, ref.dq, 1.0 / math.sqrt(case.D))


def _repair(p: Prepared, dq: torch.Tensor, causal: bool) -> None:
    torch.ops.openwam._repair_dq_(dq, p.go, p.q, p.k, p.v, p.out, p.lse, p.bias, causal, p.scale)


def _prefilled_dq(p: Prepared, layout: str, seed: int) -> torch.Tensor:
    """Finite sentinels in the rows to keep, NaN in the rows the repair writes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dq = torch.randn(p.q.shape, generator=g, device="cuda").to(p.q.dtype)
    dq = _layout(dq, layout)
    written = (p.lse < THRESHOLD).expand(p.q.shape)  # -inf rows too
    dq.masked_fill_(written, float("nan"))
    return dq


def _baseline_errors(q, k, v, go, ref_dq, rows, *, bias=None, causal=False, gqa=False) -> dict:
    """Max |dQ - ref| on `rows` of PyTorch's flash and efficient backends
    (those that serve the inputs)."""
    errors = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        res = run_stock(backend, *leaves, go, attn_mask=bias, is_causal=causal, enable_gqa=gqa)
        if res is not None:
            errors[name] = float((res.dq.double()[rows] - ref_dq[rows]).abs().max())
    return errors


def _rule_problem(dq, ref_dq, rows, baselines, dtype) -> Optional[str]:
    """The error rule on `rows`: max |dq - ref| <= 2 x the worse baseline
    + a quarter ulp of the largest reference entry. A message, or None."""
    if not baselines:
        pytest.skip("neither flash nor efficient attention serves these inputs")
    ours = float((dq.double()[rows] - ref_dq[rows]).abs().max())
    worst = max(baselines.values())
    bound = 2 * worst + floor_for(ref_dq[rows], dtype)
    if ours <= bound:
        return None
    return (f"repaired rows: max error {ours:.3e} > 2 x worst stock {worst:.3e} + floor "
            f"({baselines})")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_repair_rows(case, suite_results):
    p = _prepare(case)
    lse = p.lse.squeeze(-1)
    recompute = torch.isfinite(lse) & (lse < THRESHOLD)
    empty = lse == float("-inf")
    keep = ~(recompute | empty)
    if case.rows != "none":
        assert bool(recompute.any()), "construction failed: no row below the threshold"
    dq_in = _prefilled_dq(p, case.layout, case.seed + 2)
    dq = _layout(dq_in, case.layout)  # a copy in the same layout (clone() would densify)
    _repair(p, dq, case.causal)

    assert int((~torch.isfinite(dq)).sum()) == 0, "the repair left non-finite values"
    assert torch.equal(dq[keep], dq_in[keep]), "rows above the threshold changed"
    assert bool((dq[empty] == 0).all()), "rows with logsumexp -inf are not zero"
    if not bool(recompute.any()):
        return

    baselines = _baseline_errors(p.q, p.k, p.v, p.go, p.ref_dq, recompute, bias=p.bias,
                                 causal=case.causal, gqa=case.kv_heads is not None)
    ours = float((dq.double()[recompute] - p.ref_dq[recompute]).abs().max())
    suite_results.put("repair_dq", case.id, rows=int(recompute.sum()), ours=f"{ours:.3e}",
                      **{k: f"{e:.3e}" for k, e in baselines.items()})
    problem = _rule_problem(dq, p.ref_dq, recompute, baselines, DTYPES[case.dtype])
    assert problem is None, problem


def test_repair_is_deterministic_and_idempotent():
    """Twice on the same inputs gives the same bits; repairing a repaired dQ
    changes nothing."""
    case = Case(rows=0.1, s_kv=192)
    p = _prepare(case)
    dq = _prefilled_dq(p, case.layout, 1)
    again = dq.clone()
    _repair(p, dq, False)
    _repair(p, again, False)
    assert torch.equal(dq, again)
    twice = dq.clone()
    _repair(p, twice, False)
    assert torch.equal(dq, twice)


def test_stock_cudnn_nan_rows_repaired():
    """Stock cuDNN's own forward and backward at s_kv = 704 (the key-tail
    defect writes NaN into the adversarial rows on cuDNN 9.19): the repair
    on its output, logsumexp and dQ leaves no NaN and every other row as
    cuDNN wrote it."""
    from openwam_sdpa.adversarial import adversarial_inputs

    q, k, v, go, affected = adversarial_inputs(2, 4, 128, 704, 128, rows="one_per_head",
                                               device="cuda", seed=3, requires_grad=True)
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
    out, lse = fwd[0].detach(), fwd[1].detach()
    with torch.nn.attention.sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out_autograd = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    dq_stock = torch.autograd.grad(out_autograd, q, go)[0]
    low = lse.squeeze(-1) < THRESHOLD
    assert torch.equal(low, affected), "logsumexp below the threshold off the adversarial rows"
    dq = dq_stock.clone()
    torch.ops.openwam._repair_dq_(dq, go, q.detach(), k.detach(), v.detach(), out, lse, None,
                                  False, 128 ** -0.5)
    assert int((~torch.isfinite(dq)).sum()) == 0
    assert torch.equal(dq[~low], dq_stock[~low]), "rows the repair must not touch changed"
    ref, _ = reference(q, k, v, go)
    baselines = _baseline_errors(q, k, v, go, ref.dq, low)
    problem = _rule_problem(dq, ref.dq, low, baselines, q.dtype)
    assert problem is None, problem


def test_cuda_graph_replay():
    """Captured once, the repair recomputes whatever rows the replayed data
    puts below the threshold (the decision is on the GPU), bit for bit as
    eagerly."""
    cases = [Case(rows=0.1, s_kv=192), Case(rows="one_per_head", s_kv=192),
             Case(rows="all", s_kv=192)]
    prepared = [_prepare(c) for c in cases]
    first = prepared[0]
    static = [t.clone() for t in (first.go, first.q, first.k, first.v, first.out, first.lse)]
    static_dq = _prefilled_dq(first, "bhsd", 0)
    dq_source = static_dq.clone()

    def step():
        static_dq.copy_(dq_source)
        torch.ops.openwam._repair_dq_(static_dq, *static, None, False, first.scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: the kernels' one-time set-up happens outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for i, p in enumerate(prepared):
        for dst, src in zip(static, (p.go, p.q, p.k, p.v, p.out, p.lse)):
            dst.copy_(src)
        dq_source.copy_(_prefilled_dq(p, "bhsd", 10 + i))
        graph.replay()
        eager = dq_source.clone()
        _repair(p, eager, False)
        torch.cuda.synchronize()
        assert torch.equal(static_dq, eager), f"replay {i} differs from eager"
        assert int((~torch.isfinite(static_dq)).sum()) == 0


def test_repaired_rows_counter(ow):
    """openwam_sdpa.repaired_rows() counts the rows the GPU recomputed in
    backward passes: one per (b, h) here, twice, then 0 after a reset."""
    from openwam_sdpa.adversarial import adversarial_inputs

    if not hasattr(ow, "repaired_rows"):
        pytest.skip("openwam_sdpa.repaired_rows() is not in this build")
    q, k, v, go, affected = adversarial_inputs(2, 4, 128, 704, 128, rows="one_per_head",
                                               device="cuda", seed=4, requires_grad=True)
    plan = ow.explain(q, k, v)["plan"]
    if "repair_dq" not in plan:
        pytest.skip(f"the default plan here is {plan!r}, not the dQ repair")
    ow.repaired_rows(reset=True)
    for _ in range(2):
        out = ow.sdpa(q, k, v)
        torch.autograd.grad(out, (q, k, v), go)
    expected = 2 * int(affected.sum())
    assert ow.repaired_rows() == expected
    assert ow.repaired_rows(reset=True) == expected
    assert ow.repaired_rows() == 0


_FRESH_THREAD_CHILD = """
import threading, torch
import openwam_sdpa  # registers torch.ops.openwam
from openwam_sdpa.adversarial import adversarial_inputs
q, k, v, go, affected = adversarial_inputs(2, 4, 128, 192, 128, rows="one_per_head",
                                           device="cuda", seed=6)
out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                              False, False)[:2]
def repair(dq):
    torch.ops.openwam._repair_dq_(dq, go, q, k, v, out, lse, None, False, 128 ** -0.5)
eager = torch.full_like(q, float("nan"))
threaded = torch.full_like(q, float("nan"))
repair(eager)  # the kernel's one-time set-up, on this thread
torch.cuda.synchronize()
errors = []
def worker():  # its first CUDA call is the repair's launch
    try:
        repair(threaded)
    except Exception as e:
        errors.append(repr(e))
t = threading.Thread(target=worker)
t.start()
t.join()
torch.cuda.synchronize()
rows = lse.squeeze(-1) < openwam_sdpa.REPAIR_LSE_THRESHOLD
print("ERRORS", errors, "AFFECTED", int(rows.sum()),
      "SAME", bool(torch.equal(eager[rows], threaded[rows])),
      "NONFINITE", int((~threaded[rows].isfinite()).sum()))
"""


def test_first_cuda_call_of_a_thread_is_the_repair():
    """The repair launches through the driver API (cuLaunchKernelEx), which
    needs a current context, unlike the runtime's launches. A thread whose
    first CUDA call is the repair on device 0 has none: CUDAGuard skips
    cudaSetDevice when the device is already the thread's current one. Each
    thread binds the device's primary context before its first launch. A
    fresh process, so that nothing else has bound a context on the new
    thread."""
    child = subprocess.run([sys.executable, "-c", _FRESH_THREAD_CHILD], capture_output=True,
                           text=True, timeout=300)
    log = f"exit {child.returncode}\nstdout:\n{child.stdout}\nstderr:\n{child.stderr[-3000:]}"
    assert child.returncode == 0, log
    assert "ERRORS [] AFFECTED 8 SAME True NONFINITE 0" in child.stdout, log
