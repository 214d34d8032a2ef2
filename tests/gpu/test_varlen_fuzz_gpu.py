"""Differential fuzz of sdpa_varlen's default engine on packed batches.

Each run draws OPENWAM_VARLEN_FUZZ_CASES cases (default 500) from a seed that
changes per run (OPENWAM_VARLEN_FUZZ_SEED replays one; it is in every failure
message). A case packs 1-12 sequences with lognormal lengths (mu ln 64,
sigma 1.2, clipped to [1, 1,024]), some of them 1 and some 0; key lengths
equal the query lengths or are drawn apart (cross attention); query heads over
1, 2 or 4 key/value heads; head_dim 64/128/192/256; bf16 or fp16; is_causal
or not; and in each sequence with keys one adversarial query row (its
logsumexp about -115: cuDNN's defect rows) or none.

Rule, per sequence and per tensor (out, dQ, dK, dV): the op's max error
against F.sdpa on that sequence alone in float64 is at most twice the best
finite stock backend's on that sequence (FlashAttention-2, efficient
attention and cuDNN through F.sdpa, each on the sequence alone, K/V repeated
to the query heads) plus the floor (a quarter ulp at the tensor's largest
entry); the adversarial rows' dQ is held to the same rule by its relative
error, with the suite's row floor. Where no stock backend is finite the op
must be. Dropout cases (10%): finite, and the output unbiased.
"""

from __future__ import annotations

import math
import os
import random
import time

import torch

import openwam_sdpa
from support import load_tool, twice_stock_problem

from .conftest import GPU_MARKS, LOW_ROW_FLOOR, SDPBackend, floor_for

pytestmark = GPU_MARKS

sweep = load_tool("sweep_varlen_ragged.py")
CASES = int(os.environ.get("OPENWAM_VARLEN_FUZZ_CASES", "500"))
SEED = int(os.environ.get("OPENWAM_VARLEN_FUZZ_SEED", str(time.time_ns() % 2**31)))
STOCK = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def draw(rng: random.Random) -> dict:
    n = rng.randint(1, 12)

    def lengths():
        out = []
        for _ in range(n):
            u = rng.random()
            out.append(0 if u < 0.05 else 1 if u < 0.15 else
                       max(1, min(1024, int(math.exp(rng.gauss(math.log(64), 1.2))))))
        return out

    lens_q = lengths()
    lens_k = None if rng.random() < 0.6 else [max(1, x) for x in lengths()]
    kv = rng.choice((1, 2, 4))
    return dict(lens_q=lens_q, lens_k=lens_k, H=kv * rng.choice((1, 2, 4)), Hkv=kv,
                D=rng.choice((64, 128, 192, 256)),
                dtype=rng.choice((torch.bfloat16, torch.float16)),
                causal=rng.random() < 0.5, low=rng.choice(("last", "first", "none")),
                dropout=0.125 if rng.random() < 0.1 else 0.0, seed=rng.randrange(1 << 30))


def spans(cu) -> list[tuple[int, int]]:
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def sequence_attn(p, b, causal, backend=None):
    """F.sdpa on sequence b alone: out, dQ, dK, dV in float64 (backend None:
    math on float64 inputs, the reference), or None where the backend
    refuses it."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    (q0, q1), (k0, k1) = spans(p.cu_q)[b], spans(p.cu_k)[b]
    rep = p.q.shape[1] // p.k.shape[1]
    cast = (lambda t: t.detach().double()) if backend is None else (lambda t: t.detach().clone())
    q, k, v = (cast(t).requires_grad_() for t in (p.q[q0:q1], p.k[k0:k1], p.v[k0:k1]))
    heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    try:
        with sdpa_kernel([backend] if backend is not None else [SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(
                heads_first(q), heads_first(k).repeat_interleave(rep, 1),
                heads_first(v).repeat_interleave(rep, 1), is_causal=causal)[0].transpose(0, 1)
    except RuntimeError:
        return None
    grads = torch.autograd.grad(out, (q, k, v), p.go[q0:q1].to(out.dtype))
    return sweep.Attn(out.detach().double(), *(g.double() for g in grads))


def check(i: int, c: dict, backends: dict) -> str | None:
    p = sweep.packed_adversarial(c["lens_q"], c["lens_k"], H=c["H"], Hkv=c["Hkv"], D=c["D"],
                                 low=c["low"], dtype=c["dtype"], seed=c["seed"])
    where = f"case {i} (OPENWAM_VARLEN_FUZZ_SEED={SEED}): {c}"
    gqa = c["H"] != c["Hkv"]
    engine = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                         dropout_p=c["dropout"], is_causal=c["causal"],
                                         enable_gqa=gqa)["backend"]
    backends[engine] = backends.get(engine, 0) + 1
    out = openwam_sdpa.varlen_sdpa(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                   dropout_p=c["dropout"], is_causal=c["causal"], enable_gqa=gqa)
    ours = sweep._grads(out, p)
    bad = [n for n in sweep.Attn._fields if sweep.nonfinite(getattr(ours, n))]
    if bad:
        return f"{where}: non-finite {bad}"
    if c["dropout"]:
        ref = sweep.reference(p, c["causal"])
        diff = (ours.out.double() - ref.out).flatten()
        if diff.numel() > 1 and abs(float(diff.mean())) > \
                6 * float(diff.std()) / math.sqrt(diff.numel()) + 1e-6:
            return f"{where}: dropout output biased (mean {float(diff.mean()):.3e})"
        return None
    low = set(p.low_rows)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(spans(p.cu_q), spans(p.cu_k))):
        if q1 == q0 or k1 == k0:
            continue  # no attention (a sequence without keys: test_varlen_gpu's)
        ref = sequence_attn(p, b, c["causal"])
        stock = [s for s in (sequence_attn(p, b, c["causal"], be) for be in STOCK) if s]
        mine = sweep.Attn(ours.out[q0:q1], ours.dq[q0:q1], ours.dk[k0:k1], ours.dv[k0:k1])
        rows = [r - q0 for r in low if q0 <= r < q1]
        for n in sweep.Attn._fields:
            r = getattr(ref, n)
            skip = rows if n == "dq" and rows else None
            errs = [sweep.max_err(getattr(s, n), r, skip) for s in stock]
            best = min([e for e in errs if math.isfinite(e)], default=math.inf)
            if not math.isfinite(best):
                continue  # no finite stock backend: finite is the bar (checked above)
            problem = twice_stock_problem(f"{n} of sequence {b}",
                                          sweep.max_err(getattr(mine, n), r, skip), best,
                                          floor_for(r, c["dtype"]))
            if problem:
                return f"{where}: {problem}"
        if rows:
            errs = [sweep.row_rel_err(s.dq, ref.dq, rows) for s in stock]
            best = min([e for e in errs if math.isfinite(e)], default=math.inf)
            problem = twice_stock_problem(f"adversarial dQ rows of sequence {b} (relative error)",
                                          sweep.row_rel_err(mine.dq, ref.dq, rows), best,
                                          LOW_ROW_FLOOR)
            if math.isfinite(best) and problem:
                return f"{where}: {problem}"
    return None


def test_varlen_fuzz_against_stock(suite_results):
    rng = random.Random(SEED)
    failures, backends = [], {}
    t0 = time.time()
    for i in range(CASES):
        problem = check(i, draw(rng), backends)
        if problem:
            failures.append(problem)
            print(f"varlen fuzz: FAILED {problem}", flush=True)
        if (i + 1) % 25 == 0:
            print(f"varlen fuzz: seed {SEED}, {i + 1} cases in {time.time() - t0:.0f} s, "
                  f"{len(failures)} failed, engines {backends}", flush=True)
    suite_results.put("varlen fuzz", f"seed {SEED}", cases=CASES, failed=len(failures),
                      engines=backends)
    assert not failures, f"{len(failures)} of {CASES} failed:\n" + "\n".join(failures[:10])

