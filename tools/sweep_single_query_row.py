"""Where does cuDNN's single-query-row backward defect fire? (GPU only.)

cudnn-frontend #1072: with batch 1 and one query row whose logsumexp is very
negative, cuDNN's SDPA backward writes NaN into every element of dK and dV.
This sweep maps the region on the GPU in hand, through stock
F.scaled_dot_product_attention restricted to cuDNN, and checks that
openwam_sdpa at default settings gives no non-finite gradient on every cell
stock gets wrong. It also times a forward+backward of the affected shapes,
stock cuDNN against openwam_sdpa (paired rounds), to give the fix's cost.

    python tools/sweep_single_query_row.py --out OUT_DIR

Writes OUT_DIR/sweep_sq1.json (every cell) and OUT_DIR/sweep_sq1.md (the
failing region and the cost). About a minute on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import openwam_sdpa
from openwam_sdpa.adversarial import adversarial_inputs


def make_cell(B, H, Hkv, s_q, s_kv, D, lse, mask, causal, dtype=torch.bfloat16):
    """Inputs whose row 0 of every (b, h) has logsumexp about `lse`
    ("masked": that row sees no key; its logsumexp is then whatever the
    backend makes of a fully masked row)."""
    if lse == "masked":
        a = adversarial_inputs(B, H, s_q, s_kv, D, rows="none", kv_heads=Hkv,
                               dtype=dtype, device="cuda", seed=1)
    else:
        target = lse - math.log(s_kv)  # every logit of the row: lse = target + ln(s_kv)
        a = adversarial_inputs(B, H, s_q, s_kv, D, rows="first", target=target,
                               kv_heads=Hkv, dtype=dtype, device="cuda", seed=1)
    attn_mask = None
    if mask != "none" or lse == "masked":
        g = torch.Generator(device="cpu").manual_seed(2)
        visible = torch.rand(B, 1, s_q, s_kv, generator=g) < 0.8
        visible[..., 0] = True
        if lse == "masked":
            visible[:, :, 0, :] = False
        visible = visible.cuda()
        attn_mask = visible if mask in ("none", "bool") else torch.where(
            visible, torch.zeros((), device="cuda"), float("-inf")).to(dtype)
    return a, attn_mask


def nonfinite_grads(attention, a, attn_mask, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.query, a.key, a.value))
    out = attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                    enable_gqa=k.shape[1] != q.shape[1])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), a.grad_out)
    return [int((~torch.isfinite(g)).sum()) for g in (dq, dk, dv)]


def stock_cudnn(q, k, v, **kw):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def cells():
    # A: the region in batch, s_q, heads, s_kv and the logsumexp threshold.
    for B, s_q, H, s_kv, lse in itertools.product(
            (1, 2, 3), (1, 2), (1, 4), (64, 128, 704, 1024),
            (-60, -70, -80, -85, -88, -89, -90, -95, -100, -122, "masked")):
        yield dict(part="A", B=B, H=H, Hkv=H, s_q=s_q, s_kv=s_kv, D=128, lse=lse,
                   mask="none", causal=False)
    # B: masks, causal, grouped-query attention and head_dim at batch 1, one row.
    for mask, causal, gqa, D, s_kv, lse in itertools.product(
            ("none", "bool", "additive"), (False, True), (False, True), (64, 128, 256),
            (64, 128, 1000), (-60, -100, -122, "masked")):
        if causal and (mask != "none" or lse == "masked"):
            continue  # is_causal takes no mask
        yield dict(part="B", B=1, H=4, Hkv=1 if gqa else 4, s_q=1, s_kv=s_kv, D=D,
                   lse=lse, mask=mask, causal=causal)


def paired_ms(fns, args_for, rounds=8, reps=20):
    """Median per-round ms of fwd+bwd for each fn, fns timed in rotating order."""
    per = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for name in order:
            q, k, v, go, kw = args_for()
            for _ in range(3):
                torch.autograd.grad(fns[name](q, k, v, **kw), (q, k, v), go)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.autograd.grad(fns[name](q, k, v, **kw), (q, k, v), go)
            torch.cuda.synchronize()
            per[name].append((time.perf_counter() - t0) * 1e3 / reps)
    return {name: statistics.median(v) for name, v in per.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stack = dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                 gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rows = []
    for cell in cells():
        a, attn_mask = make_cell(cell["B"], cell["H"], cell["Hkv"], cell["s_q"], cell["s_kv"],
                                 cell["D"], cell["lse"], cell["mask"], cell["causal"])
        try:
            stock = nonfinite_grads(stock_cudnn, a, attn_mask, cell["causal"])
        except RuntimeError as e:
            stock = f"error: {str(e).splitlines()[0][:120]}"
        ours = nonfinite_grads(openwam_sdpa.sdpa, a, attn_mask, cell["causal"])
        rows.append(dict(cell, stock_dq_dk_dv=stock, openwam_dq_dk_dv=ours))

    def dkdv_bad(r):
        s = r["stock_dq_dk_dv"]
        return isinstance(s, list) and (s[1] > 0 or s[2] > 0)

    failing = [r for r in rows if dkdv_bad(r)]
    ours_bad = [r for r in rows if sum(r["openwam_dq_dk_dv"]) > 0]

    # Cost of the fix on affected shapes: batch 1, one query row.
    def case(s_kv, H=16, D=128):
        def make():
            a = adversarial_inputs(1, H, 1, s_kv, D, rows="none", dtype=torch.bfloat16,
                                   device="cuda", requires_grad=True)
            return a.query, a.key, a.value, a.grad_out, {}
        return make
    costs = {}
    for s_kv in (512, 4096):
        t = paired_ms({"stock": F.scaled_dot_product_attention, "openwam": openwam_sdpa.sdpa},
                      case(s_kv))
        costs[f"B1 H16 1x{s_kv} D128"] = dict(t, ratio=t["openwam"] / t["stock"])

    result = dict(stack=stack, cells=rows, failing=len(failing), cells_total=len(rows),
                  openwam_nonfinite_cells=len(ours_bad), cost_ms=costs)
    (args.out / "sweep_sq1.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Single-query-row backward sweep ({stack['gpu']}, torch {stack['torch']}, "
             f"cuDNN {stack['cudnn']}, {stack['date']})", "",
             f"{len(rows)} cells; stock cuDNN gave non-finite dK/dV in {len(failing)}; "
             f"openwam_sdpa (default settings) gave non-finite gradients in {len(ours_bad)}.", "",
             "| part | B | H | Hkv | s_q | s_kv | D | lse | mask | causal | stock non-finite dQ/dK/dV | openwam |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["stock_dq_dk_dv"]
        if dkdv_bad(r) or sum(r["openwam_dq_dk_dv"]) or (isinstance(s, list) and s[0] and r["part"] == "B"):
            lines.append("| {part} | {B} | {H} | {Hkv} | {s_q} | {s_kv} | {D} | {lse} | {mask} | {causal} | "
                         "{stock_dq_dk_dv} | {openwam_dq_dk_dv} |".format(**r))
    pairs = {(r["B"], r["s_q"]) for r in rows}
    clean = sorted(pairs - {(r["B"], r["s_q"]) for r in rows if dkdv_bad(r)})
    lines += ["", f"(B, s_q) pairs with no dK/dV failure at any lse: {clean}", "",
              "Cost, fwd+bwd ms (median of paired rounds):", ""]
    for name, c in costs.items():
        lines.append(f"- {name}: stock {c['stock']:.3f}, openwam {c['openwam']:.3f} ({c['ratio']:.2f}x)")
    (args.out / "sweep_sq1.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4] + lines[-4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
