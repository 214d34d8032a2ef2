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


def per_sequence_errors(x, ref, cu) -> list[float]:
    return [float((x[a:b].double() - ref[a:b]).abs().max()) if b > a else 0.0
            for a, b in spans(cu)]


def stock_errors(p, causal, ref):
    """{tensor: [per-sequence error of the best finite stock backend]}."""
    from torch.nn.attention import sdpa_kernel

    best = {n: [math.inf] * (p.cu_q.numel() - 1) for n in sweep.Attn._fields}
    for backend in STOCK:
        try:
            with sdpa_kernel([backend]):
                got = sweep._per_sequence(p, causal, lambda t: t.detach().clone().requires_grad_())
        except RuntimeError:
            continue  # the backend refuses a sequence's shape
        for n in sweep.Attn._fields:
            cu = p.cu_k if n in ("dk", "dv") else p.cu_q
            for i, e in enumerate(per_sequence_errors(getattr(got, n), getattr(ref, n), cu)):
                if math.isfinite(e):
                    best[n][i] = min(best[n][i], e)
    return best


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
    ref = sweep.reference(p, c["causal"])
    if c["dropout"]:
        diff = (ours.out.double() - ref.out).flatten()
        if diff.numel() > 1 and abs(float(diff.mean())) > \
                6 * float(diff.std()) / math.sqrt(diff.numel()) + 1e-6:
            return f"{where}: dropout output biased (mean {float(diff.mean()):.3e})"
        return None
    best = stock_errors(p, c["causal"], ref)
    for n in sweep.Attn._fields:
        r = getattr(ref, n)
        cu = p.cu_k if n in ("dk", "dv") else p.cu_q
        floor = floor_for(r, c["dtype"])
        rows = p.low_rows if n == "dq" else None
        for b, ((lo, hi), err) in enumerate(zip(spans(cu), per_sequence_errors(
                getattr(ours, n), r, cu))):
            seq_rows = [x - lo for x in (rows or []) if lo <= x < hi]
            if seq_rows:  # the adversarial row's dQ: by its relative error, below
                keep = [x for x in range(hi - lo) if x not in seq_rows]
                err = sweep.max_err(getattr(ours, n)[lo:hi][keep], r[lo:hi][keep]) if keep else 0.0
            if math.isfinite(best[n][b]) and not seq_rows:
                problem = twice_stock_problem(f"{n} of sequence {b}", err, best[n][b], floor)
                if problem:
                    return f"{where}: {problem}"
    if p.low_rows:
        stock = sweep.reference(p, c["causal"], stock=True)  # efficient, per sequence
        problem = twice_stock_problem(
            "adversarial dQ rows (relative error)",
            sweep.row_rel_err(ours.dq, ref.dq, p.low_rows),
            sweep.row_rel_err(stock.dq, ref.dq, p.low_rows), LOW_ROW_FLOOR)
        if problem:
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
        if (i + 1) % 100 == 0:
            print(f"varlen fuzz: seed {SEED}, {i + 1} cases in {time.time() - t0:.0f} s, "
                  f"{len(failures)} failed, engines {backends}", flush=True)
    suite_results.put("varlen fuzz", f"seed {SEED}", cases=CASES, failed=len(failures),
                      engines=backends)
    assert not failures, f"{len(failures)} of {CASES} failed:\n" + "\n".join(failures[:10])

