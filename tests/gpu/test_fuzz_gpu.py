"""Differential fuzz: the op against the best stock backend, on random
adversarial inputs at default settings.

Each run draws OPENWAM_FUZZ_CASES cases (default 1,000) from a seed that
changes per run (OPENWAM_FUZZ_SEED replays one, OPENWAM_FUZZ_CASE=i,j only
those cases of it; both are in every failure message, the seed in the
suite's results record). A case draws batch 1-8, query heads over 1, 2 or 4
key/value heads at GQA ratios 1/2/4/8, s_q 1-2,048,
s_kv either = 64 (mod 128) or anything from 2 to 2,048, head_dim
64/80/96/128/192/256, bf16 or fp16, BHSD or BSHD storage, no mask, a bool
key mask, an additive mask, a left-padded causal mask (fully masked rows) or
is_causal, and a share of adversarial rows (none, one per head, 10%, all) in
one of two forms: the shared key component spread over every dimension
(openwam_sdpa.adversarial) or held by one ("massive activation": K's first
component + 10). Sizes are capped so that a case stays small.

Rule, for the output and each gradient: the op's max error against an fp32
reference is at most twice the best finite stock backend's (cuDNN, flash,
efficient, all with K/V repeated to the query heads) plus a floor of a
quarter ulp at the tensor's largest entry (for dQ and dK of one query under
is_causal, which sees one key, so that they are 0 exactly:
support.zero_gradient_floor, a few fp32 ulps of the terms that cancel), or at
most twice the error of
stock F.sdpa called as the user calls it (PyTorch's choice, native GQA) where
that is finite, or, where stock as called is not finite (cuDNN's NaN), no
worse than the worse of flash and efficient attention or at most twice the
error of stock cuDNN on the same attention with the keys zero-padded to a
multiple of 128 and masked (cuDNN's own arithmetic without its defect). That
last clause is counted apart ("admitted by key-padded stock cuDNN"): on the
H200 (cuDNN 9.19.0) the op's dQ on adversarial rows equals key-padded stock
cuDNN's (its error to three digits at head_dim 64-256), and cuDNN's own dQ
there is 0.5x-2.0x the worse of flash and efficient at key residues where
stock is finite, up to 5.2x at head_dim 96 where it is not
(docs/performance.md#correctness-evidence). The second clause keeps
stock's own accuracy from failing the op: cuDNN's dK on these inputs can be 3.4x the best backend's, and the op's dK
is bitwise cuDNN's there (measured on the H200, cuDNN 9.19). Both ratios are
recorded. Where no stock backend (stock as called included) is finite the op must still
be finite.
Dropout cases (5%) cannot be compared element by element: there the op must
be finite and its output unbiased (the mean of out - ref over 16 dropout draws
within 6 standard errors of zero: support.dropout_bias).
"""

from __future__ import annotations

import functools
import math
import os
import random
import time

import pytest
import torch
import torch.nn.functional as F

import openwam_sdpa
from openwam_sdpa.adversarial import adversarial_inputs, as_layout, left_padding_mask
from support import (Attn, contract_clause, dropout_bias, floor_for, max_err, nonfinite,
                     replayed_cases, run, zero_gradient_floor)
from .conftest import GPU_MARKS, SDPBackend, run_stock, stock_cudnn_padded

pytestmark = GPU_MARKS

CASES = int(os.environ.get("OPENWAM_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("OPENWAM_FUZZ_SEED", str(time.time_ns() % 2**31)))
ONLY, CASES = replayed_cases("OPENWAM_FUZZ_CASE", CASES)
# Elements of a case's attention matrix (B * H * s_q * s_kv), at most.
MAX_SCORES = 1 << 22
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
MASKS = ("none", "bool", "additive", "left_padded", "causal")
SHARES = ("none", "one_per_head", 0.1, "all")
STOCK = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw(rng: random.Random) -> dict:
    kv_heads = rng.choice((1, 2, 4))
    c = dict(dtype=rng.choice(DTYPES), D=rng.choice(HEAD_DIMS), kv_heads=kv_heads,
             H=kv_heads * rng.choice((1, 2, 4, 8)), B=rng.randint(1, 8),
             s_q=log_uniform(rng, 1, 2048), layout=rng.choice(("bhsd", "bshd")),
             mask=rng.choice(MASKS), rows=rng.choice(SHARES),
             form=rng.choice(("spread", "one_dim")),
             dropout=0.125 if rng.random() < 0.05 else 0.0, seed=rng.randrange(2**31))
    c["s_kv"] = (128 * rng.randint(0, 15) + 64 if rng.random() < 0.5
                 else log_uniform(rng, 2, 2048))
    if c["mask"] == "left_padded":  # a padded batch: queries and keys are one sequence
        c["s_kv"] = c["s_q"] = max(c["s_q"], 2)
    while c["B"] * c["H"] * c["s_q"] * c["s_kv"] > MAX_SCORES:
        if c["B"] > 1:
            c["B"] //= 2
        elif c["H"] > c["kv_heads"]:
            c["H"] //= 2
        elif c["s_q"] > 1 and c["mask"] != "left_padded":
            c["s_q"] //= 2
        else:
            c["s_kv"] = c["s_q"] = c["s_kv"] // 2
    return c


def inputs(c: dict, device="cuda"):
    """q, k, v (leaves, requiring grad), grad_out, attn_mask, is_causal."""
    B, H, Hkv, s_q, s_kv, D = c["B"], c["H"], c["kv_heads"], c["s_q"], c["s_kv"], c["D"]
    a = adversarial_inputs(B, H, s_q, s_kv, D, rows=c["rows"], kv_heads=Hkv, dtype=torch.float32,
                           seed=c["seed"])
    q, k, v, go = a.query, a.key, a.value, a.grad_out
    if c["form"] == "one_dim":  # the shared component in K's first dimension alone
        g = torch.Generator().manual_seed(c["seed"] + 1)
        k = torch.randn(B, Hkv, s_kv, D, generator=g)
        k[..., 0] += 10.0
        low = torch.zeros(B, H, s_q, D)
        low[..., 0] = -115.0 * math.sqrt(D) / 10.0
        q = torch.where(a.affected.unsqueeze(-1), low, q)
    g = torch.Generator().manual_seed(c["seed"] + 2)
    mask, causal = None, False
    if c["mask"] == "causal":
        causal = True
    elif c["mask"] == "bool":
        keep = torch.rand(B, 1, 1, s_kv, generator=g) < 0.8
        keep[..., 0] = True
        mask = keep
    elif c["mask"] == "additive":
        mask = torch.randn(B, 1, s_q, s_kv, generator=g)
        mask[..., s_kv - s_kv // 4:] = float("-inf") if s_kv > 3 else 0.0
    elif c["mask"] == "shared_additive":  # one [L, S] mask for every batch element and head
        mask = torch.randn(s_q, s_kv, generator=g)
        mask[:, s_kv - s_kv // 4:] = float("-inf") if s_kv > 3 else 0.0
    elif c["mask"] == "left_padded":
        lengths = torch.randint(1, s_q + 1, (B,), generator=g)
        mask = left_padding_mask(lengths, s_q)

    def finish(t):
        t = as_layout(t.to(device=device, dtype=c["dtype"]), c["layout"])
        return t.requires_grad_()

    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(device=device, dtype=c["dtype"])
    elif mask is not None:
        mask = mask.to(device)
    return (finish(q), finish(k), finish(v), go.to(device=device, dtype=c["dtype"]), mask,
            causal)


def reference(q, k, v, go, mask, causal) -> Attn:
    """fp32 math backend on the same (rounded) values, K/V repeated."""
    g = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    m32 = mask.float() if mask is not None and mask.dtype != torch.bool else mask
    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q32, k32.repeat_interleave(g, 1),
                                             v32.repeat_interleave(g, 1), attn_mask=m32,
                                             is_causal=causal)
    dq, dk, dv = torch.autograd.grad(out, (q32, k32, v32), go.float())
    return Attn(out.detach(), dq, dk, dv)


def best_stock(q, k, v, go, mask, causal) -> dict:
    """Per tensor, {backend: result} of every stock backend that ran and was
    finite there."""
    results = {name: run_stock(getattr(SDPBackend, name), q, k, v, go, attn_mask=mask,
                               is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
               for name in STOCK}
    return {field: {name: getattr(res, field) for name, res in results.items()
                    if res is not None and nonfinite(getattr(res, field)) == 0}
            for field in Attn._fields}


def as_called(q, k, v, go, mask, causal) -> Attn | None:
    """Stock F.sdpa as the user calls it: PyTorch's backend choice, native GQA."""
    try:
        return run(F.scaled_dot_product_attention, q, k, v, go, attn_mask=mask,
                   is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    except RuntimeError:
        return None


def zero_floor(name, q, k, v, go) -> float:
    """support.zero_gradient_floor over the batch: the floor of dQ or dK
    where one query under is_causal sees key 0 alone, so that their exact
    value is 0 and the reference's own too."""
    per_seq = lambda t, b: t[b].transpose(0, 1)  # noqa: E731  (B, H, S, D) -> (S, H, D)
    return max(zero_gradient_floor(name, per_seq(q, b), per_seq(k, b), per_seq(v, b),
                                   per_seq(go, b)) for b in range(q.shape[0]))


def check_case(i: int, c: dict, worst: dict, cudnn_admitted: list) -> str | None:
    """None when case `i` holds the rule; else what broke. worst keeps, per
    tensor, the largest err / best stock backend's and err / stock as called
    (the README's measured ratios), each with the case that gave it;
    cudnn_admitted collects the cases that only the key-padded stock cuDNN
    clause admits."""
    q, k, v, go, mask, causal = inputs(c)
    gqa = c["H"] != c["kv_heads"]
    where = f"case {i} (OPENWAM_FUZZ_SEED={SEED} OPENWAM_FUZZ_CASE={i}): {c}"
    ref = reference(q, k, v, go, mask, causal)
    op = functools.partial(openwam_sdpa.sdpa, attn_mask=mask, is_causal=causal,
                           dropout_p=c["dropout"], enable_gqa=gqa)
    ours = run(op, q, k, v, go)
    if c["dropout"]:
        bad = [n for n in Attn._fields if nonfinite(getattr(ours, n))]
        if bad:
            return f"{where}: non-finite {bad} with dropout"
        bias = dropout_bias(lambda: op(q, k, v), ref.out)
        if not bias <= 6:
            return f"{where}: dropout output biased ({bias:.1f} standard errors)"
        return None
    stock = best_stock(q, k, v, go, mask, causal)
    called = as_called(q, k, v, go, mask, causal)
    padded, admitted = [], {}  # key-padded stock cuDNN: run once, where a clause needs it

    def key_padded_err(name, r):
        if not padded:
            padded.append(stock_cudnn_padded(q, k, v, go, attn_mask=mask, is_causal=causal,
                                             enable_gqa=gqa))
        return max_err(getattr(padded[0], name), r) if padded[0] is not None else math.inf

    for name in Attn._fields:
        x, r = getattr(ours, name), getattr(ref, name)
        err = max_err(x, r)
        if not math.isfinite(err):
            return f"{where}: {name} has {nonfinite(x)} non-finite elements"
        errs = {backend: max_err(t, r) for backend, t in stock[name].items()}
        yard = min(errs.values(), default=math.inf)
        user = max_err(getattr(called, name), r) if called is not None else math.inf
        if not errs and not math.isfinite(user):
            continue  # no finite stock backend: finite is the bar
        flash_efficient = max((errs[b] for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")
                               if b in errs), default=-math.inf)
        floor = floor_for(r, c["dtype"])
        if name in ("dq", "dk") and causal and q.shape[-2] == 1:  # s_kv >= 2 here
            floor = max(floor, zero_floor(name, q, k, v, go))
        for against, e in (("best stock", yard), ("as called", user)):
            key = f"{name} / {against}"
            if 0 < e < math.inf and err / e > worst.get(key, (0.0,))[0]:
                worst[key] = (err / e, i)
        clause = contract_clause(err, floor, best=yard, as_called=user,
                                 flash_efficient=flash_efficient,
                                 key_padded=lambda: key_padded_err(name, r))
        if clause is None:
            return (f"{where}: {name} error {err:.3e} > 2 x best stock {yard:.3e} + floor "
                    f"{floor:.3e}, > 2 x stock as called {user:.3e} + floor, and (where stock "
                    f"as called is not finite) > the worse of flash and efficient "
                    f"({flash_efficient:.3e}) and > 2 x key-padded stock cuDNN + floor")
        if clause == "key-padded cuDNN":
            admitted[name] = (f"{name} {err:.3e} (best stock {yard:.3e}, as called {user:.3e}, "
                              f"flash/efficient {flash_efficient:.3e}, key-padded cuDNN "
                              f"{key_padded_err(name, r):.3e}, floor {floor:.3e})")
    if admitted:
        cudnn_admitted.append(i)
        print(f"fuzz: {where}: admitted by key-padded stock cuDNN: "
              + "; ".join(admitted.values()), flush=True)
    return None


def test_fuzz_against_stock(suite_results):
    rng = random.Random(SEED)
    failures, counts, worst, cudnn_admitted = [], {"cases": 0, "dropout": 0}, {}, []
    t0 = time.time()
    for i in range(CASES):
        c = draw(rng)
        if ONLY and i not in ONLY:
            continue
        problem = check_case(i, c, worst, cudnn_admitted)
        counts["cases"] += 1
        counts["dropout"] += bool(c["dropout"])
        if problem:
            failures.append(problem)
            print(f"fuzz: FAILED {problem}", flush=True)
        if (i + 1) % 100 == 0:  # a run stopped at its time cap still reports how far it got
            print(f"fuzz: seed {SEED}, {i + 1} cases in {time.time() - t0:.0f} s, "
                  f"{len(failures)} failed", flush=True)
    suite_results.put("fuzz", f"seed {SEED}", cases=counts["cases"], dropout=counts["dropout"],
                      failed=len(failures), seconds=round(time.time() - t0, 1),
                      admitted_by_key_padded_cudnn=len(cudnn_admitted),
                      **{f"worst {n}": [round(r, 3), case] for n, (r, case) in sorted(worst.items())})
    print(f"fuzz: seed {SEED}, {counts['cases']} cases, {len(failures)} failed, "
          f"{len(cudnn_admitted)} admitted by key-padded stock cuDNN alone, worst error ratios: "
          + ", ".join(f"{n} {r:.2f} (case {case})" for n, (r, case) in sorted(worst.items())))
    assert not failures, (f"{len(failures)} of {counts['cases']} cases failed:\n"
                          + "\n".join(failures[:10]))


# head_dim 160 (a head_dim cuDNN takes, in no draw above: adding it there
# would change what every recorded seed replays): fixed cases across GQA, causal
# with s_q != s_kv, masks and shares up to every row.
D160 = [dict(dtype=dtype, D=160, kv_heads=kv, H=h, B=b, s_q=s_q, s_kv=s_kv, layout=layout,
             mask=mask, rows=rows, form=form, dropout=0.0, seed=160 + i)
        for i, (dtype, kv, h, b, s_q, s_kv, layout, mask, rows, form) in enumerate([
            (torch.bfloat16, 4, 16, 2, 307, 320, "bhsd", "causal", "all", "one_dim"),
            (torch.bfloat16, 2, 16, 3, 311, 300, "bshd", "bool", 0.1, "spread"),
            (torch.float16, 1, 8, 1, 1, 192, "bhsd", "none", "all", "spread"),
            (torch.bfloat16, 4, 4, 2, 200, 200, "bshd", "left_padded", "one_per_head", "one_dim"),
            (torch.float16, 2, 4, 2, 64, 448, "bhsd", "additive", "all", "one_dim"),
        ])]


@pytest.mark.parametrize("c", D160, ids=lambda c: f"{c['mask']}-{c['rows']}-{c['s_q']}x{c['s_kv']}")
def test_head_dim_160_against_stock(c):
    worst, cudnn_admitted = {}, []
    problem = check_case(0, c, worst, cudnn_admitted)
    assert problem is None, problem
