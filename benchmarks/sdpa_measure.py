"""How the op benchmark measures one case of each section (driven by bench_sdpa.py).

Every failure is recorded in the result ("error"), never raised: one broken
method or out-of-memory case must not cost the rest of a GPU run.
"""

from __future__ import annotations

import importlib
import json
import time
import warnings

import torch

import timing
from sdpa_cases import BASE, ShareInputs, make_inputs, memory_inputs, to_bhsd


def error_text(e, limit=600):
    return f"{type(e).__name__}: {e}"[:limit]


def step_fns(method, leaves, grad, mask, layout):
    """(fwd, bwd): fwd() runs the method's forward; bwd(out) the gradient call, returning the grads."""

    def fwd(_=None):
        q, k, v = (to_bhsd(t, layout) for t in leaves)
        return method.call(q, k, v, mask)

    def bwd(out):
        return torch.autograd.grad(out, leaves, grad)

    return fwd, bwd


def decision(ow, leaves, mask, layout):
    """openwam_sdpa.explain() on the inputs as a JSON-safe dict; a failure is recorded, not raised."""
    try:
        q, k, v = (to_bhsd(t, layout) for t in leaves)
        return json.loads(json.dumps(ow.explain(q, k, v, attn_mask=mask), default=str))
    except Exception as e:  # noqa: BLE001
        return {"error": error_text(e, 300)}


def nonfinite(tensors):
    return int(sum((~torch.isfinite(t)).sum().item() for t in tensors))


def saved_bytes(fwd, leaves, mask):
    """Bytes of the unique storages autograd saves during fwd() (total / beyond q,k,v / new)."""
    seen = {}

    def key(t):
        s = t.untyped_storage()
        return (str(s.device), s.data_ptr()), s.nbytes()

    def pack(t):
        k, nbytes = key(t)
        seen[k] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fwd()
    inputs = {key(t)[0] for t in leaves}
    held = inputs | {key(out)[0]} | ({key(mask)[0]} if mask is not None else set())
    del out
    return {"total_bytes": sum(seen.values()),
            "beyond_inputs_bytes": sum(n for k, n in seen.items() if k not in inputs),
            "new_bytes": sum(n for k, n in seen.items() if k not in held),
            "storages": len(seen)}


def free_memory(record):
    """Synchronise and return cached memory; a sticky CUDA error is recorded in record."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - later cases will record it too
        record["cleanup_error"] = error_text(e, 300)


# ------------------------------------------------------------- methods section


def measure_method(ow, method, leaves, grad, mask, layout, ref_out, warmup, repeats):
    """Every figure of one method on one input set, timed on its own (not paired)."""
    if method.no_mask_only and mask is not None:
        return {"skipped": f"{method.name} takes no mask"}
    fwd, bwd = step_fns(method, leaves, grad, mask, layout)
    rec = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with method.context():
                if method.openwam:
                    rec["decision"] = decision(ow, leaves, mask, layout)
                out = fwd()
                grads = bwd(out)
                rec["finite"] = nonfinite([out, *grads]) == 0
                if ref_out is not None:
                    rec["fwd_equal_cudnn"] = bool(torch.equal(out, ref_out))
                    rec["fwd_max_abs_diff"] = (out.float() - ref_out.float()).abs().max().item()
                del out, grads
                rec["saved"] = saved_bytes(fwd, leaves, mask)
                rec["peak_mib"] = timing.peak_mib(lambda: bwd(fwd()))
                rec["fwd"] = timing.per_call_ms(fwd, warmup, repeats)
                rec["fwd_dev"] = timing.device_ms(fwd, warmup, repeats)
                rec["bwd_dev"] = timing.device_ms(bwd, warmup, repeats, setup=fwd)
                rec["fwdbwd_dev"] = timing.device_ms((fwd, bwd), warmup, repeats)
                rec["bwd"] = timing.per_call_ms(bwd, warmup, repeats, setup=fwd)
                rec["fwdbwd"] = timing.per_call_ms(lambda _: bwd(fwd()), warmup, repeats)
        except Exception as e:  # noqa: BLE001 - record and go on
            rec["error"] = error_text(e)
    msgs = sorted({str(w.message)[:300] for w in caught})
    if msgs:
        rec["warnings"] = msgs
    return rec


# Per-round figures of the paired timing: device ms, and the host's per-call time.
PAIRED_KEYS = ("fwd", "fwdbwd", "fwd_host_us", "bwd_host_us")


def paired(ow, contenders, leaves, grad, mask, layout, ref_out, rounds, warmup, repeats):
    """Stock cuDNN, openwam_sdpa as shipped and stock again, in rounds (timing.paired_rounds).

    Each round times every contender's forward and forward+backward as device
    time; the host time of each forward and backward call is taken on the way.
    """
    fns = {m.name: step_fns(m, leaves, grad, mask, layout) for m in contenders}
    out = {"rounds": rounds, "repeats": repeats, "fwd_equal_cudnn": {}}
    for m in contenders[1:]:
        with m.context():
            out["fwd_equal_cudnn"][m.name] = ref_out is not None and bool(torch.equal(fns[m.name][0](), ref_out))
            if m.openwam:
                out["decision"] = decision(ow, leaves, mask, layout)

    def measure(m):
        fwd, bwd = fns[m.name]
        f = timing.device_ms(fwd, warmup, repeats)
        fb = timing.device_ms((fwd, bwd), warmup, repeats)
        fh, bh = f["host_us"][0], fb["host_us"][1]
        return {"fwd": f["median_ms"], "fwdbwd": fb["median_ms"],
                "fwd_host_us": fh["median_us"], "fwd_host_p10_us": fh["p10_us"], "fwd_host_p90_us": fh["p90_us"],
                "bwd_host_us": bh["median_us"], "bwd_host_p10_us": bh["p10_us"], "bwd_host_p90_us": bh["p90_us"],
                "covered": None if f["covered"] is None else f["covered"] and fb["covered"]}

    runs = timing.paired_rounds(contenders, measure, rounds)
    base = contenders[0].name
    out["ms"] = runs
    out["ratios"] = {m.name: {k: timing.round_ratios(runs, m.name, base, k) for k in PAIRED_KEYS}
                     for m in contenders[1:]}
    out["host_deltas_us"] = {m.name: {k: timing.round_deltas(runs, m.name, base, k)
                                      for k in ("fwd_host_us", "bwd_host_us")} for m in contenders[1:]}
    return out


def reference_out(cudnn, leaves, mask, layout):
    """Stock cuDNN's forward output in grad mode (detached), or None if it fails."""
    try:
        with cudnn.context():
            return cudnn.call(*(to_bhsd(t, layout) for t in leaves), mask).detach()
    except Exception:  # noqa: BLE001 - the cudnn record carries the error
        return None


def new_case(shape, layout):
    return {"shape": vars(shape).copy(), "label": shape.label(), "mask": shape.mask_label(),
            "mask_shape": shape.mask_shape(), "layout": layout, "methods": {}}


def run_case(ow, methods, contenders, shape, layout, device, seed, args):
    """The methods section on one shape x layout: every method, then the paired contenders."""
    case = new_case(shape, layout)
    try:
        leaves, grad, mask = make_inputs(shape, layout, device, seed)
        ref = reference_out(next(m for m in methods if m.name == BASE), leaves, mask, layout)
        for m in methods:
            case["methods"][m.name] = measure_method(ow, m, leaves, grad, mask, layout, ref,
                                                     args.warmup, args.repeats)
        if contenders and args.paired_rounds > 0:
            try:
                case["paired"] = paired(ow, contenders, leaves, grad, mask, layout, ref, args.paired_rounds,
                                        args.warmup, args.paired_repeats)
            except Exception as e:  # noqa: BLE001 - record and go on
                case["paired"] = {"error": error_text(e)}
        del leaves, grad, mask, ref
    except Exception as e:  # noqa: BLE001 - e.g. out of memory building inputs
        case["error"] = error_text(e)
    free_memory(case)
    return case


# -------------------------------------------------------------- shares section

# A contender's time in one round of the shares section stays near this: the
# repeats shrink (to SHARE_MIN_REPEATS) when a method is slow at a share.
SHARE_ROUND_MS = 150.0
SHARE_MIN_REPEATS = 3


def share_cell(ow, contenders, leaves, grad, mask, affected, args):
    """One shape at one share: non-finite gradients and repaired rows per contender, then paired
    fwd+bwd device time."""
    cell = {"affected_rows": affected, "checks": {}}
    fns = {m.name: step_fns(m, leaves, grad, mask, "bhsd") for m in contenders}  # leaves are views
    slowest = 0.0
    for m in contenders:
        fwd, bwd = fns[m.name]
        check = {}
        try:
            with m.context():
                if m.openwam:
                    check["decision"] = decision(ow, leaves, mask, "bhsd")
                counter = getattr(ow, "repaired_rows", None) if m.openwam else None
                if counter:
                    counter(reset=True)
                grads = bwd(fwd())
                check["nonfinite"] = {n: nonfinite([g]) for n, g in zip(("dq", "dk", "dv"), grads)}
                if counter:
                    check["repaired_rows"] = counter()
                del grads
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                bwd(fwd())
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001
            check["error"] = error_text(e)
        cell["checks"][m.name] = check
    if any("error" in c for c in cell["checks"].values()):
        return cell
    repeats = max(SHARE_MIN_REPEATS, min(args.share_repeats, int(SHARE_ROUND_MS / max(slowest, 1e-3))))

    def measure(m):
        fwd, bwd = fns[m.name]
        t = timing.device_ms((fwd, bwd), 1, repeats)
        return {"fwdbwd": t["median_ms"], "covered": t["covered"]}

    runs = timing.paired_rounds(contenders, measure, args.share_rounds)
    base, default, always = contenders[0].name, "openwam-default", "openwam-always"
    cell.update(rounds=args.share_rounds, repeats=repeats, ms=runs)
    cell["ratios"] = {m.name: timing.round_ratios(runs, m.name, base, "fwdbwd") for m in contenders[1:]}
    cell["ratios"]["default_vs_always"] = timing.round_ratios(runs, default, always, "fwdbwd")
    return cell


def run_share_shape(ow, contenders, shape, device, seed, args):
    """The shares section on one shape: a cell per share (openwam_sdpa.adversarial inputs)."""
    entry = {"shape": vars(shape).copy(), "label": shape.label(), "mask": shape.mask_label(), "cells": {}}
    try:
        inputs = ShareInputs(importlib.import_module("openwam_sdpa.adversarial"), shape, device, seed)
        for share in args.shares:
            try:
                leaves, grad, mask, affected = inputs.select(share)
                entry["cells"][str(share)] = share_cell(ow, contenders, leaves, grad, mask, affected, args)
                del leaves
            except Exception as e:  # noqa: BLE001
                entry["cells"][str(share)] = {"error": error_text(e)}
        del inputs
    except Exception as e:  # noqa: BLE001 - e.g. openwam_sdpa missing, out of memory
        entry["error"] = error_text(e)
    free_memory(entry)
    return entry


# -------------------------------------------------------------- memory section


def run_memory_case(ow, methods, case, device, seed, repeats):
    """Peak memory of one forward+backward (and of the forward alone) per method, with a large mask."""
    entry = {"case": vars(case).copy(), "label": case.label(), "mask": case.mask_label(), "methods": {}}
    try:
        leaves, grad, mask = memory_inputs(case, device, seed)
        entry["mask_mib"] = mask.untyped_storage().nbytes() / 2.0**20
        for m in methods:
            fwd, bwd = step_fns(m, leaves, grad, mask, "bhsd")
            rec = {}
            try:
                with m.context():
                    if m.openwam:
                        rec["decision"] = decision(ow, leaves, mask, "bhsd")
                    out = fwd()
                    grads = bwd(out)
                    rec["finite"] = nonfinite([out, *grads]) == 0
                    del out, grads
                    rec["peak_mib"] = timing.peak_mib(lambda: bwd(fwd()))
                    rec["fwd_peak_mib"] = timing.peak_mib(fwd)
                    rec["fwdbwd_dev"] = timing.device_ms((fwd, bwd), 0, repeats)["median_ms"]
            except Exception as e:  # noqa: BLE001 - an out-of-memory is a result here
                rec["error"] = error_text(e)
            free_memory(rec)
            entry["methods"][m.name] = rec
        del leaves, grad, mask
    except Exception as e:  # noqa: BLE001
        entry["error"] = error_text(e)
    free_memory(entry)
    return entry
