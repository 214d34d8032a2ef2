"""Does cuDNN's ragged layout (sdpa_varlen's cuDNN engine) have the key-tail
and one-query-row defects, and is it right? (GPU only.)

Every cell packs sequences, puts one adversarial query row (logsumexp about
-115) in each sequence where the cell says so, runs an engine's forward and
backward through sdpa_varlen's leaf op (no guard row in the way), and
records the non-finite counts of out, dQ, dK and dV, their max errors against
F.sdpa on each sequence alone in float64, the same errors of stock F.sdpa on
the padded batch (efficient attention, and cuDNN with its NaN counted), and
the time of one forward+backward. Through ATen's own ragged call it found
that layout wrong on cuDNN 9.19 (pytorch #186142); on the frontend's graphs
(csrc/cudnn_frontend/ragged_engine.h) it admits the engine there, the
guard row `ragged_unmeasured` keeps every other version off, and
`ragged_adversarial_dq_9.19` keeps 9.19.0's default to head_dim 64, 128 and
256 (the varlen fuzz's finding at 192). The
leaf runs outside the op's decision: FlashAttention-2's causal cells with
s_q != s_k show its bottom-right alignment, which sdpa_varlen never uses
(those calls take the block-diagonal fallback).

    python tools/sweep_varlen_ragged.py [--engines cudnn,flash] [--cells a,b] [--out DIR]

One JSON line per (cell, engine) on stdout; with --out, DIR/varlen_ragged_sweep.json.
A cell that hangs is the caller's to time out (tests/gpu/test_varlen_gpu.py runs
each cell in its own process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import openwam_sdpa
from openwam_sdpa.adversarial import adversarial_inputs
from openwam_sdpa.varlen import cu_seqlens_from_lengths

LEAF = torch.ops.openwam._sdpa_varlen
ENGINE_BITS = {"flash": 1, "cudnn": 2}
LSE = -115.0


class Attn(NamedTuple):
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class Packed(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    go: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    low_rows: list  # packed query rows made adversarial


def packed_adversarial(lens_q, lens_k=None, *, H=4, Hkv=None, D=128, low="last", lse=LSE,
                       dtype=torch.bfloat16, device="cuda", seed=0) -> Packed:
    """Sequences built by openwam_sdpa.adversarial one at a time and packed:
    with low="last" ("first") the last (first) query row of every sequence
    with keys has every logit near lse - ln(s_k), so its logsumexp is about
    `lse`; low="none" gives ordinary rows only."""
    lens_k = list(lens_q) if lens_k is None else list(lens_k)
    Hkv = H if Hkv is None else Hkv
    qs, ks, vs, gos, low_rows = [], [], [], [], []
    offset = 0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows = torch.zeros(max(lq, 1), dtype=torch.bool)
        if low != "none" and lq > 0 and lk > 0:
            rows[-1 if low == "last" else 0] = True
            low_rows.append(offset + (lq - 1 if low == "last" else 0))
        a = adversarial_inputs(1, H, max(lq, 1), max(lk, 1), D, rows=rows,
                               target=lse - math.log(max(lk, 1)), kv_heads=Hkv,
                               dtype=torch.float32, device="cpu", seed=seed + i)
        qs.append(a.query[0, :, :lq].transpose(0, 1))
        gos.append(a.grad_out[0, :, :lq].transpose(0, 1))
        ks.append(a.key[0, :, :lk].transpose(0, 1))
        vs.append(a.value[0, :, :lk].transpose(0, 1))
        offset += lq
    def leaf(parts):
        return torch.cat(parts).to(device=device, dtype=dtype).contiguous().requires_grad_()
    q, k, v = leaf(qs), leaf(ks), leaf(vs)
    go = torch.cat(gos).to(device=device, dtype=dtype)
    cu_q, max_q = cu_seqlens_from_lengths(lens_q, device)
    if list(lens_k) == list(lens_q):
        cu_k, max_k = cu_q, max_q  # one tensor: FlashAttention-2 may serve causal calls
    else:
        cu_k, max_k = cu_seqlens_from_lengths(lens_k, device)
    return Packed(q, k, v, go, cu_q, cu_k, max_q, max_k, low_rows)


def _grads(out, p: Packed) -> Attn:
    dq, dk, dv = torch.autograd.grad(out, (p.q, p.k, p.v), p.go.to(out.dtype),
                                     allow_unused=True)
    z = [torch.zeros_like(t) for t in (p.q, p.k, p.v)]
    return Attn(out.detach(), *(g if g is not None else zz for g, zz in zip((dq, dk, dv), z)))


def reference(p: Packed, is_causal=False, stock=False) -> Attn:
    """F.sdpa on each sequence alone: math in float64, or with stock=True
    efficient attention in the packed dtype (stock's own rounding: the
    yardstick for an engine's error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if stock:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return _per_sequence(p, is_causal, lambda t: t.detach().clone().requires_grad_())
    return _per_sequence(p, is_causal, lambda t: t.detach().double().requires_grad_())


def _per_sequence(p: Packed, is_causal, leaf) -> Attn:
    qd, kd, vd = (leaf(t) for t in (p.q, p.k, p.v))
    rep = qd.shape[1] // kd.shape[1]
    outs = []
    for b in range(p.cu_q.numel() - 1):
        q0, q1 = int(p.cu_q[b]), int(p.cu_q[b + 1])
        k0, k1 = int(p.cu_k[b]), int(p.cu_k[b + 1])
        qs = qd[q0:q1].transpose(0, 1)
        ks = kd[k0:k1].transpose(0, 1).repeat_interleave(rep, 0)
        vs = vd[k0:k1].transpose(0, 1).repeat_interleave(rep, 0)
        if k1 == k0 or q1 == q0:  # nothing attends: zero output, zero gradients
            out = qs.new_zeros(qs.shape[:-1] + (vs.shape[-1],)) + 0 * (qs.sum() + ks.sum()
                                                                        + vs.sum())
        else:
            # [1, H, s, D]: the fused kernels take 4-D inputs only
            out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None],
                                                 is_causal=is_causal)[0]
        outs.append(out.transpose(0, 1))
    out = torch.cat(outs)
    ref = Packed(qd, kd, vd, p.go.to(qd.dtype), *p[4:])
    return _grads(out, ref)


def padded_stock(p: Packed, is_causal=False, backend=None) -> Attn | None:
    """Stock F.sdpa on the padded batch [B, H, S, D] with a key-padding (and
    causal) mask, mapped back to the packed rows; None when the backend
    refuses it. backend: an SDPBackend, or None for PyTorch's own choice."""
    from torch.nn.attention import sdpa_kernel

    B = p.cu_q.numel() - 1
    Sq, Sk = max(p.max_q, 1), max(p.max_k, 1)
    lq = (p.cu_q[1:] - p.cu_q[:-1]).long()
    lk = (p.cu_k[1:] - p.cu_k[:-1]).long()
    pos_q = torch.arange(Sq, device=p.q.device)
    pos_k = torch.arange(Sk, device=p.q.device)
    real_q = pos_q[None] < lq[:, None]
    real_k = pos_k[None] < lk[:, None]

    def to_padded(t, real, S):
        buf = t.new_zeros((B * S,) + tuple(t.shape[1:]))
        idx = torch.nonzero(real.reshape(-1)).flatten()
        return buf.index_copy(0, idx, t).view(B, S, *t.shape[1:]).transpose(1, 2), idx

    q, qi = to_padded(p.q, real_q, Sq)
    k, _ = to_padded(p.k, real_k, Sk)
    v, _ = to_padded(p.v, real_k, Sk)
    mask = real_k[:, None, None, :].expand(B, 1, Sq, Sk)
    if is_causal:
        mask = mask & (pos_k[None, :] <= pos_q[:, None])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    try:
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    except RuntimeError:
        return None
    out = out.transpose(1, 2).reshape(B * Sq, out.shape[1], out.shape[3])  # packed-row order
    return _grads(out.index_select(0, qi), p)


def run_engine(engine: str, p: Packed, is_causal=False) -> Attn:
    """An engine of sdpa_varlen on the packed inputs: the leaf op itself for
    flash and cudnn (no guard row in the way), the public op with
    OPENWAM_SDPA_VARLEN=block_diagonal for the fallback."""
    enable_gqa = p.q.shape[1] != p.k.shape[1]
    if engine == "block_diagonal":
        os.environ["OPENWAM_SDPA_VARLEN"] = "block_diagonal"
        openwam_sdpa.varlen_settings(reload=True)
        try:
            out = openwam_sdpa.varlen_sdpa(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                           is_causal=is_causal, enable_gqa=enable_gqa)
        finally:
            os.environ.pop("OPENWAM_SDPA_VARLEN", None)
            openwam_sdpa.varlen_settings(reload=True)
    else:
        out = LEAF(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, is_causal, None,
                   ENGINE_BITS[engine])[0]
    return _grads(out, p)


def nonfinite(t) -> int:
    return int((~torch.isfinite(t)).sum())


def max_err(x, ref, rows=None) -> float:
    if rows is not None:
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        keep[rows] = False
        x, ref = x[keep], ref[keep]
    if x.numel() == 0:
        return 0.0
    return float((x.double() - ref).abs().max())


def row_rel_err(x, ref, rows) -> float:
    """Worst relative 2-norm error (over head_dim) of the given packed rows."""
    if not rows:
        return 0.0
    num = (x[rows].double() - ref[rows]).norm(dim=-1)
    return float((num / ref[rows].norm(dim=-1).clamp_min(1e-30)).max())


def time_ms(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# name: (lens_q, lens_k, kwargs of packed_adversarial, is_causal)
CELLS = {
    # The key-tail defect: every sequence's length is 64 mod 128.
    "key_tail_d128": ([192, 320, 448, 576], None, dict(D=128), False),
    "key_tail_d64": ([192, 320, 448, 576], None, dict(D=64), False),
    "key_tail_causal": ([192, 320, 448, 576], None, dict(D=128), True),
    "key_tail_gqa": ([192, 320, 448, 576], None, dict(D=128, H=8, Hkv=2), False),
    "aligned_lengths": ([128, 256, 384, 512], None, dict(D=128), False),
    # The one-query-row defect: one query per sequence (decoding-like), and
    # one sequence of one query in a batch of one.
    "one_query_per_sequence": ([1, 1, 1, 1], [64, 128, 192, 256], dict(D=128, low="first"),
                               False),
    "batch1_one_query": ([1], [192], dict(D=128, low="first"), False),
    "batch1_one_query_causal": ([1], [192], dict(D=128, low="first"), True),
    # Head dims and dtypes beyond the defaults.
    "gqa_d256_fp16": ([192, 320, 1], None, dict(D=256, H=8, Hkv=2, dtype=torch.float16), True),
    "d192": ([192, 64, 320], None, dict(D=192), False),
    # Mixed, ordinary rows: lengths of 1, empty sequences, s_q != s_k.
    "mixed_ordinary": ([5, 1, 300, 0, 77], None, dict(D=128, low="none"), True),
    "cross_lengths": ([40, 3, 130], [70, 200, 5], dict(D=64, low="none"), True),
}


def sweep_cell(name: str, engines):
    """Yields one row per engine, as each finishes (a hang leaves the rows
    before it printed)."""
    lens_q, lens_k, make, causal = CELLS[name]
    from torch.nn.attention import SDPBackend

    p = packed_adversarial(lens_q, lens_k, **make)
    ref = reference(p, causal)
    stock_eff = padded_stock(p, causal, SDPBackend.EFFICIENT_ATTENTION)
    stock_cudnn = padded_stock(p, causal, SDPBackend.CUDNN_ATTENTION)
    for engine in engines:
        row = {"cell": name, "engine": engine, "lens_q": lens_q, "lens_k": lens_k or lens_q,
               "is_causal": causal, **{k: str(v) if isinstance(v, torch.dtype) else v
                                       for k, v in make.items()},
               "low_rows": len(p.low_rows)}
        try:
            r = run_engine(engine, p, causal)
            torch.cuda.synchronize()
        except RuntimeError as e:
            row["error"] = str(e).splitlines()[0][:200]
            yield row
            continue
        for n in Attn._fields:
            row[f"nonfinite_{n}"] = nonfinite(getattr(r, n))
            row[f"err_{n}"] = max_err(getattr(r, n), getattr(ref, n), None)
            if stock_eff is not None:
                row[f"stock_padded_efficient_err_{n}"] = max_err(getattr(stock_eff, n),
                                                                 getattr(ref, n))
            if stock_cudnn is not None:
                row[f"stock_padded_cudnn_nonfinite_{n}"] = nonfinite(getattr(stock_cudnn, n))
        row["low_rows_rel_err_dq"] = row_rel_err(r.dq, ref.dq, p.low_rows)
        if stock_eff is not None:
            row["stock_padded_efficient_low_rows_rel_err_dq"] = row_rel_err(
                stock_eff.dq, ref.dq, p.low_rows)
        row["ms_fwd_bwd"] = round(time_ms(lambda: run_engine(engine, p, causal)), 3)
        yield row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="flash,block_diagonal,cudnn")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_varlen_ragged: needs a CUDA GPU", file=sys.stderr)
        return 2
    engines = [e for e in args.engines.split(",") if e]
    cells = [c for c in args.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS] + [
        e for e in engines if e not in ("cudnn", "flash", "block_diagonal")]
    if unknown:
        parser.error(f"unknown cells or engines: {unknown}")
    rows = []
    for name in cells:
        for row in sweep_cell(name, engines):
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "varlen_ragged_sweep.json"), "w") as f:
            json.dump({"stack": {"torch": torch.__version__,
                                 "cudnn": torch.backends.cudnn.version(),
                                 "gpu": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
