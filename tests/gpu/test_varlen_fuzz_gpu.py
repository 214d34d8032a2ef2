"""Differential fuzz of sdpa_varlen's default engine on packed batches.

Each run draws OPENWAM_VARLEN_FUZZ_CASES cases (default 500) from a seed that
changes per run (OPENWAM_VARLEN_FUZZ_SEED replays one; it is in every failure
message). A case packs 1-12 sequences with lognormal lengths (mu ln 64,
sigma 1.2, clipped to [1, 1,024]), some of them 1 and some 0; key lengths
equal the query lengths or are drawn apart (cross attention); query heads over
1, 2 or 4 key/value heads; head_dim 64/128/192/256; bf16 or fp16; is_causal
or not; and in each sequence with keys one adversarial query row (its
logsumexp about -115: cuDNN's defect rows) or none.

Rule, per sequence and per tensor (out, dQ, dK, dV), the project's accuracy
contract (the dense fuzz's): the op's max error against F.sdpa on that
sequence alone in float64 is at most twice the error of stock PyTorch on the
same inputs, plus the floor (a quarter ulp at the tensor's largest entry).
Stock PyTorch is either F.sdpa as called on that sequence alone (PyTorch's
own backend choice: cuDNN here) or PyTorch's own varlen kernel on the whole
pack (FlashAttention-2's; not for is_causal with s_q != s_k, which it aligns
bottom-right); the op passes within twice either. They can differ 2.6x: on
one query row over 126 keys, fp16 dQ errors of 5.6e-5 and 1.5e-4 (about an
ulp), where the op's cuDNN ragged engine matched FlashAttention-2's to the
bit (H200, cuDNN 9.19.0). Where stock as called is not finite (cuDNN's NaN),
twice the worse of FlashAttention-2 and efficient attention passes too. The
adversarial rows' dQ is held to the same rule by its relative error, with the
suite's row floor, and one more clause, counted apart ("admitted by key-padded stock
cuDNN"): twice the error of stock cuDNN on the sequence with its keys
zero-padded to a multiple of 128 and masked, the attention a padded batch
hands stock F.sdpa (under is_causal with s_q <= s_k no mask is needed: the
diagonal hides the padded keys). On the first sequence measured to need the
clause (85 x 85, head_dim 192, bf16, its first row adversarial) the ragged
engine's relative dQ error on that row equals key-padded stock cuDNN's with a
mask to every digit, 4.7x stock as called's; on the second (34 tokens,
is_causal, head_dim 192) it is 9x key-padded stock cuDNN's and the clause
does not admit it (H200 and H100, cuDNN 9.19.0;
docs/varlen.md#measured-on-the-gpu): the engine now leaves head_dim 192 to
FlashAttention-2 by default. Where no stock backend is
finite the op must be. Dropout cases (10%): finite, and the output unbiased
(support.dropout_bias, over 16 draws).
The worst ratio to the best of the three stock backends on each sequence, and
how many (sequence, tensor) pairs lie outside twice that best plus the floor
(issue 44's literal rule; the adversarial rows' relative dQ included), are
printed, not asserted (the class Literal): on one sequence the three round
differently by up to 2-5x, and the engines themselves (FlashAttention-2 varlen
included) exceed twice the best of them there. The count runs under the
contract's floor and under the tensor-core floor (support.tensor_core_attention:
the error of rounding P and dS to the dtype, as every stock kernel does), for
the op and for FlashAttention-2 varlen on the same pack: in 1,024 cases, 11 of
the op's pairs and 9 of FlashAttention-2's lay outside under the second (H100,
cuDNN 9.19.0; docs/varlen.md).

A query row that sees one key (a sequence with one key, or the first row
under is_causal) has dQ = 0 exactly, and a sequence with one key, or with
one query under is_causal (it sees key 0 alone), has dQ = dK = 0:
the kernels' result there is rounding noise around 0 (about 1e-7), where a
relative error is undefined and a floor at the tensor's own largest entry is
0. Such a row stays in the max-norm rule with its sequence's other rows, not
in the relative one; such a tensor's floor is taken at the largest entry of
the same tensor over the whole pack (the packed gradient the user holds), or
where that is 0 too (a pack of such sequences) at the accumulator's rounding
of the terms that cancel (support.zero_gradient_floor: on one causal query
over two heads sharing one key, head_dim 192, bf16, stock gave 2.5e-7 and the
ragged engine 5.0e-7 there; H100, cuDNN 9.19.0, docs/varlen.md).

OPENWAM_VARLEN_FUZZ_CASE (a comma-separated list of case numbers, in every
failure message) checks only those cases of the seed's draw.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import time

import torch

import openwam_sdpa
from support import (dropout_bias, load_tool, packed_yardstick, replayed_cases,
                     tensor_core_attention, twice_stock_problem, within_key_padded,
                     zero_gradient_floor)

from .conftest import GPU_MARKS, LOW_ROW_FLOOR, SDPBackend, floor_for, stock_cudnn_padded

pytestmark = GPU_MARKS

sweep = load_tool("sweep_varlen_ragged.py")
CASES = int(os.environ.get("OPENWAM_VARLEN_FUZZ_CASES", "500"))
SEED = int(os.environ.get("OPENWAM_VARLEN_FUZZ_SEED", str(time.time_ns() % 2**31)))
ONLY, CASES = replayed_cases("OPENWAM_VARLEN_FUZZ_CASE", CASES)
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
    math on float64 inputs, the reference; "called": PyTorch's own choice in
    the packed dtype), or None where the backend refuses it."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    (q0, q1), (k0, k1) = spans(p.cu_q)[b], spans(p.cu_k)[b]
    rep = p.q.shape[1] // p.k.shape[1]
    cast = (lambda t: t.detach().double()) if backend is None else (lambda t: t.detach().clone())
    q, k, v = (cast(t).requires_grad_() for t in (p.q[q0:q1], p.k[k0:k1], p.v[k0:k1]))
    heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    try:
        with (contextlib.nullcontext() if backend == "called" else
              sdpa_kernel([backend] if backend is not None else [SDPBackend.MATH])):
            out = F.scaled_dot_product_attention(
                heads_first(q), heads_first(k).repeat_interleave(rep, 1),
                heads_first(v).repeat_interleave(rep, 1), is_causal=causal)[0].transpose(0, 1)
    except RuntimeError:
        return None
    grads = torch.autograd.grad(out, (q, k, v), p.go[q0:q1].to(out.dtype))
    return sweep.Attn(out.detach().double(), *(g.double() for g in grads))


def sequence_key_padded_dq(p, b, causal):
    """Stock cuDNN on sequence b alone with its keys zero-padded to a multiple
    of 128 and masked (conftest.stock_cudnn_padded): cuDNN's own arithmetic
    without its key-tail defect. dQ in float64, or None where it cannot run
    (is_causal with more queries than keys, a key length already a multiple
    of 128, a refusal)."""
    (q0, q1), (k0, k1) = spans(p.cu_q)[b], spans(p.cu_k)[b]
    heads_first = lambda t: t.detach().clone().transpose(0, 1)[None].requires_grad_()  # noqa: E731
    q, k, v = (heads_first(t) for t in (p.q[q0:q1], p.k[k0:k1], p.v[k0:k1]))
    go = p.go[q0:q1].transpose(0, 1)[None].to(q.dtype)
    got = stock_cudnn_padded(q, k, v, go, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return None if got is None else got.dq[0].transpose(0, 1).double()


def stock_varlen(p, causal):
    """PyTorch's own varlen kernel on the whole pack: FlashAttention-2's
    (aten::_flash_attention_forward, what flash_attn_varlen_func users and
    transformers' packed flash path run), out, dQ, dK, dV in float64; None
    where it refuses the inputs. Its is_causal aligns a sequence with
    s_q != s_k bottom-right, not as F.sdpa: check() uses it only on the others."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    try:
        out = torch.ops.aten._flash_attention_forward(q, k, v, p.cu_q, p.cu_k, p.max_q,
                                                      p.max_k, 0.0, causal, False)[0]
        grads = torch.autograd.grad(out, (q, k, v), p.go.to(out.dtype))
    except RuntimeError:
        return None
    return sweep.Attn(out.detach().double(), *(g.double() for g in grads))


def yardstick(errs: dict, called: float, varlen: float) -> float:
    """support.packed_yardstick on one tensor's errors per stock backend."""
    return packed_yardstick(called, varlen, errs.get(SDPBackend.FLASH_ATTENTION, math.inf),
                            errs.get(SDPBackend.EFFICIENT_ATTENTION, math.inf))


class Literal:
    """Issue 44's literal rule, counted: the (sequence, tensor) pairs whose
    error lies outside twice the best of the three stock backends on the
    sequence plus the floor, for the op and for FlashAttention-2 varlen, under
    two floors: the contract's (a quarter ulp, or the zero-gradient floor)
    and the tensor-core floor, the error of support.tensor_core_attention
    (exact arithmetic that rounds P and dS to the dtype, as every stock kernel
    does) by the same measure where that is larger."""

    def __init__(self):
        self.pairs = {(who, floor): [] for who in ("op", "fa2") for floor in ("ulp", "tc")}

    def count(self, pair, errs: dict, best: float, floor: float, tc_floor: float):
        if not best < math.inf:
            return
        for who, err in errs.items():
            for name, f in (("ulp", floor), ("tc", max(floor, tc_floor))):
                if twice_stock_problem("", err, best, f):
                    self.pairs[who, name].append(pair + (f"{err:.2e}", f"{best:.2e}", f"{f:.1e}"))

    def summary(self) -> str:
        return "; ".join(f"{who} outside twice the best plus the {floor} floor: {len(got)} {got}"
                         for (who, floor), got in self.pairs.items())


def check(i: int, c: dict, backends: dict, worst: dict, admitted: set,
          literal: Literal) -> str | None:
    p = sweep.packed_adversarial(c["lens_q"], c["lens_k"], H=c["H"], Hkv=c["Hkv"], D=c["D"],
                                 low=c["low"], dtype=c["dtype"], seed=c["seed"])
    where = f"case {i} (OPENWAM_VARLEN_FUZZ_SEED={SEED} OPENWAM_VARLEN_FUZZ_CASE={i}): {c}"
    gqa = c["H"] != c["Hkv"]
    engine = openwam_sdpa.explain_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                         dropout_p=c["dropout"], is_causal=c["causal"],
                                         enable_gqa=gqa)["backend"]
    backends[engine] = backends.get(engine, 0) + 1
    op = functools.partial(openwam_sdpa.varlen_sdpa, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q,
                           p.max_k, dropout_p=c["dropout"], is_causal=c["causal"],
                           enable_gqa=gqa)
    ours = sweep._grads(op(), p)
    bad = [n for n in sweep.Attn._fields if sweep.nonfinite(getattr(ours, n))]
    if bad:
        return f"{where}: non-finite {bad}"
    if c["dropout"]:
        ref = sweep.reference(p, c["causal"])
        bias = dropout_bias(op, ref.out)
        if not bias <= 6:
            return f"{where}: dropout output biased ({bias:.1f} standard errors)"
        return None
    low = set(p.low_rows)
    attended = [(b, q, k) for b, (q, k) in enumerate(zip(spans(p.cu_q), spans(p.cu_k)))
                if q[1] > q[0] and k[1] > k[0]]  # a sequence without keys: test_varlen_gpu's
    refs = {b: sequence_attn(p, b, c["causal"]) for b, _, _ in attended}
    pack_max = {n: max((float(getattr(r, n).abs().max()) for r in refs.values()), default=0.0)
                for n in sweep.Attn._fields}
    packed_stock = stock_varlen(p, c["causal"]) if attended else None
    for b, (q0, q1), (k0, k1) in attended:
        ref = refs[b]
        stock = {be: s for be in STOCK if (s := sequence_attn(p, b, c["causal"], be))}
        called = sequence_attn(p, b, c["causal"], "called")
        varlen = (sweep.Attn(packed_stock.out[q0:q1], packed_stock.dq[q0:q1],
                             packed_stock.dk[k0:k1], packed_stock.dv[k0:k1])
                  if packed_stock and not (c["causal"] and q1 - q0 != k1 - k0) else None)
        mine = sweep.Attn(ours.out[q0:q1], ours.dq[q0:q1], ours.dk[k0:k1], ours.dv[k0:k1])
        tc = tensor_core_attention(p.q[q0:q1], p.k[k0:k1], p.v[k0:k1], p.go[q0:q1], c["dtype"],
                                   c["causal"])
        one_key = k1 - k0 == 1
        sees_one_key = one_key or (c["causal"] and q1 - q0 == 1)  # exact dQ = dK = 0
        # Adversarial rows that see more than one key (see the module's docstring).
        rows = [r - q0 for r in low if q0 <= r < q1 and not (one_key or c["causal"] and r == q0)]
        for n in sweep.Attn._fields:
            r = getattr(ref, n)
            skip = rows if n == "dq" and rows else None
            errs = {be: sweep.max_err(getattr(s, n), r, skip) for be, s in stock.items()}
            yard = yardstick(errs, sweep.max_err(getattr(called, n), r, skip)
                             if called else math.inf,
                             sweep.max_err(getattr(varlen, n), r, skip) if varlen else math.inf)
            if not math.isfinite(yard):
                continue  # no finite stock backend: finite is the bar (checked above)
            zero = sees_one_key and n in ("dq", "dk")
            floor = floor_for(r.new_tensor(pack_max[n]) if zero else r, c["dtype"])
            if zero and floor == 0.0:
                floor = zero_gradient_floor(n, p.q[q0:q1], p.k[k0:k1], p.v[k0:k1], p.go[q0:q1])
            err = sweep.max_err(getattr(mine, n), r, skip)
            # Stock as called may be finite where no forced backend is (PyTorch picks math).
            best = min([e for e in errs.values() if math.isfinite(e)], default=math.inf)
            if floor < best < math.inf:
                worst[n] = max(worst.get(n, 0.0), err / best)
            # (case, sequence, tensor, head_dim, engine) + (error, best of three, floor)
            literal.count((i, b, n, c["D"], engine),
                          {"op": err, **({"fa2": sweep.max_err(getattr(varlen, n), r, skip)}
                                         if varlen else {})},
                          best, floor, sweep.max_err(getattr(tc, n), r, skip))
            problem = twice_stock_problem(f"{n} of sequence {b}", err, yard, floor)
            if problem:
                return f"{where}: {problem}"
        if rows:
            errs = {be: sweep.row_rel_err(s.dq, ref.dq, rows) for be, s in stock.items()}
            yard = yardstick(errs, sweep.row_rel_err(called.dq, ref.dq, rows)
                             if called else math.inf,
                             sweep.row_rel_err(varlen.dq, ref.dq, rows) if varlen else math.inf)
            err = sweep.row_rel_err(mine.dq, ref.dq, rows)
            literal.count((i, b, "adversarial dq rows", c["D"], engine),
                          {"op": err, **({"fa2": sweep.row_rel_err(varlen.dq, ref.dq, rows)}
                                         if varlen else {})},
                          min([e for e in errs.values() if math.isfinite(e)], default=math.inf),
                          LOW_ROW_FLOOR, sweep.row_rel_err(tc.dq, ref.dq, rows))
            problem = twice_stock_problem(f"adversarial dQ rows of sequence {b} (relative error)",
                                          err, yard, LOW_ROW_FLOOR)
            if math.isfinite(yard) and problem:
                # Counted apart (the module's docstring): twice stock cuDNN's
                # error on the sequence as a padded batch holds it admits too.
                own = sequence_key_padded_dq(p, b, c["causal"])
                own_err = sweep.row_rel_err(own, ref.dq, rows) if own is not None else math.inf
                if not within_key_padded(err, own_err, LOW_ROW_FLOOR):
                    return f"{where}: {problem}; key-padded stock cuDNN {own_err:.3e}"
                admitted.add(i)
                print(f"varlen fuzz: {where}: adversarial dQ rows of sequence {b} "
                      f"({err:.3e}) admitted by key-padded stock cuDNN ({own_err:.3e})",
                      flush=True)
    return None


def test_varlen_fuzz_against_stock(suite_results):
    rng = random.Random(SEED)
    failures, backends, worst, admitted, literal = [], {}, {}, set(), Literal()
    t0 = time.time()
    for i in range(CASES):
        c = draw(rng)
        if ONLY and i not in ONLY:
            continue
        problem = check(i, c, backends, worst, admitted, literal)
        if problem:
            failures.append(problem)
            print(f"varlen fuzz: FAILED {problem}", flush=True)
        if (i + 1) % 25 == 0:
            print(f"varlen fuzz: seed {SEED}, {i + 1} cases in {time.time() - t0:.0f} s, "
                  f"{len(failures)} failed, engines {backends}, pairs outside twice the "
                  f"best: { {k: len(v) for k, v in literal.pairs.items()} }", flush=True)
    ratios = {n: round(x, 2) for n, x in worst.items()}
    print(f"varlen fuzz: seed {SEED}, {len(admitted)} admitted by key-padded stock cuDNN "
          f"alone, worst error / best stock backend's: {ratios}; (sequence, tensor) pairs: "
          f"{literal.summary()}", flush=True)
    checked = len(ONLY) if ONLY else CASES
    suite_results.put("varlen fuzz", f"seed {SEED}", cases=checked, failed=len(failures),
                      engines=backends, admitted_by_key_padded_cudnn=len(admitted),
                      worst_over_best_stock=ratios,
                      **{f"{who}_outside_twice_best_stock_{floor}_floor": len(got)
                         for (who, floor), got in literal.pairs.items()})
    assert not failures, f"{len(failures)} of {checked} failed:\n" + "\n".join(failures[:10])

