"""Benchmark openwam_sdpa against PyTorch's stock SDPA backends (bf16, training).

What it measures, per shape x layout x method:
  * forward, backward and forward+backward time: median (and p10/p90) of
    CUDA-event timings, after a short warm-up. The forward runs in grad mode on
    inputs that require grad (the training forward). Backward timing runs the
    forward outside the timed region each repeat and times only the gradient
    call; nothing is retained between repeats. Inputs are random, never zeros.
  * peak memory of one forward+backward: torch.cuda.max_memory_allocated()
    after a reset, minus the memory allocated just before the call.
  * bytes kept between forward and backward: the unique storages that autograd
    saves (torch.autograd.graph.saved_tensors_hooks, deduplicated by storage
    pointer): in total, beyond the inputs q/k/v, and "new" (beyond every
    caller-held tensor: q, k, v, mask and the output).
  * for openwam_sdpa: openwam_sdpa.explain() (backend and plan), and whether
    its forward output is bit-identical to stock cuDNN's (torch.equal).
  * every figure also as a ratio to stock cuDNN on the same shape and layout.

Methods: stock cuDNN / efficient / flash (F.scaled_dot_product_attention under
torch.nn.attention.sdpa_kernel; flash only without a mask); "pad-fwd" (the seed
approach: openwam_sdpa.pad_keys before the forward, then stock cuDNN on the
padded K/V and bool mask); openwam_sdpa.sdpa with OPENWAM_SDPA_PAD=auto, always
and never, all with OPENWAM_SDPA_CUDNN=1; "cudnn-again" (stock cuDNN measured a
second time, last: an A/A control whose ratio is the run's noise floor). The
"auto" timings include its dQ repair kernel. Per-method failures are recorded,
not raised.

The forward is also timed as device time (time_ms_device): every repeat is
enqueued behind a spin kernel, so the events hold only the call's kernels.
Per-call events include the host's launch time whenever a call is shorter
than its launches (a 0.1 ms forward is), which measures the CPU, not the GPU.
Backward and forward+backward are timed that way too.

The paired timing (paired(), --paired-rounds) answers "how much slower than
stock cuDNN is openwam_sdpa as shipped?" with drift cancelled: openwam_sdpa at
default settings (no OPENWAM_SDPA_* variable), stock cuDNN and stock cuDNN
again are timed in rounds, order rotating, and each ratio is the median of the
per-round ratios. Separate per-method timings minutes apart absorb clock and
temperature drift into their ratios (the A/A control above showed up to 4%).

Layouts: "bshd" = storage [B,S,H,D] viewed as [B,H,S,D] (.transpose(1,2)),
"bhsd" = contiguous [B,H,S,D]. The grad of the output follows the same layout.

Run (from the repository root, on a GPU):
    python benchmarks/bench_sdpa.py --out $OUT/bench
    python benchmarks/bench_sdpa.py --quick              # 3 shapes, bshd, 25 repeats
    python benchmarks/bench_sdpa.py --shapes 392,4096 --layouts bshd --repeats 30
    python benchmarks/bench_sdpa.py --selftest --out /tmp/bench   # no GPU: fake numbers
Writes bench.json (everything), bench.md (tables for BENCHMARKS.md) and
bench.png (fwd+bwd ratio to stock cuDNN) under --out. Asserts nothing about timing.
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
DTYPE = torch.bfloat16
MiB = 2.0**20
BASE = "cudnn"  # every ratio is to this method

# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One attention problem. mask: None, "q" = [B,1,Sq,Skv] or "k" = [B,1,1,Skv] (bool)."""

    name: str
    b: int
    h: int
    d: int
    sq: int
    skv: int
    mask: str = None

    def mask_shape(self):
        if self.mask is None:
            return None
        return [self.b, 1, self.sq if self.mask == "q" else 1, self.skv]

    def label(self):
        return f"B{self.b} H{self.h} D{self.d} {self.sq}x{self.skv}"

    def mask_label(self):
        return "none" if self.mask is None else "bool " + ("[B,1,Sq,Skv]" if self.mask == "q" else "[B,1,1,Skv]")


SHAPES = [
    Shape("b32_392x392_none", 32, 24, 128, 392, 392),
    Shape("b32_392x392_bool", 32, 24, 128, 392, 392, "q"),
    Shape("b32_360x64_bool", 32, 24, 128, 360, 64, "q"),
    Shape("b16_704x704_none", 16, 24, 128, 704, 704),
    Shape("b16_704x704_bool", 16, 24, 128, 704, 704, "q"),
    Shape("b32_392x392_d64_bool", 32, 24, 64, 392, 392, "q"),
    Shape("b4_4096x4000_none", 4, 24, 128, 4096, 4000),
    Shape("b4_4096x4032_bool", 4, 24, 128, 4096, 4032, "k"),
    Shape("b16_512x512_bool", 16, 24, 128, 512, 512, "q"),
]
QUICK_SHAPES = ("b32_392x392_none", "b32_392x392_bool", "b4_4096x4000_none")
LAYOUTS = ("bshd", "bhsd")

# -------------------------------------------------------------------------- methods


@dataclass
class Method:
    """How to run one method: `context()` wraps all its calls; `call(q, k, v, mask)` is the forward."""

    name: str
    context: object
    call: object
    no_mask_only: bool = False
    explain: object = None  # (q, k, v, mask) -> dict, for openwam settings


@contextlib.contextmanager
def env_vars(**values):
    """Set (None: unset) environment variables for the duration of the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    set_env(values)
    try:
        yield
    finally:
        set_env(old)


def set_env(values):
    """os.environ[k] = v for each item; v None removes k."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def import_openwam():
    """Import openwam_sdpa (falling back to <repo>/python on sys.path); returns (module, error)."""
    try:
        import openwam_sdpa
        return openwam_sdpa, None
    except Exception as first:  # noqa: BLE001 - report any import failure
        sys.path.insert(0, str(HERE.parent / "python"))
        try:
            import openwam_sdpa
            return openwam_sdpa, None
        except Exception:  # noqa: BLE001
            return None, f"{type(first).__name__}: {first}"


def build_methods(ow, ow_error):
    """All methods of one run, stock cuDNN first (it is the reference)."""

    def need_ow():
        if ow is None:
            raise RuntimeError(f"openwam_sdpa not importable: {ow_error}")
        return ow

    def stock(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def pad_fwd(q, k, v, mask):
        kp, vp, mp = need_ow().pad_keys(k, v, mask)
        if mp.dim() == 2:  # [1, S_padded] key mask -> [1, 1, 1, S_padded]
            mp = mp[None, None]
        return F.scaled_dot_product_attention(q, kp, vp, attn_mask=mp)

    def openwam(pad):
        def context():
            return env_vars(OPENWAM_SDPA_PAD=pad, OPENWAM_SDPA_CUDNN="1")

        def call(q, k, v, mask):
            return need_ow().sdpa(q, k, v, attn_mask=mask)

        def explain(q, k, v, mask):
            return need_ow().explain(q, k, v, attn_mask=mask)

        return Method(f"openwam-{pad}", context, call, explain=explain)

    return [
        Method("cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION), stock),
        Method("efficient", lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), stock),
        Method("flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION), stock, no_mask_only=True),
        Method("pad-fwd", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION), pad_fwd),
        openwam("auto"),
        openwam("always"),
        openwam("never"),
        # A/A control: stock cuDNN again, measured last. Its ratio to "cudnn"
        # is the run's noise floor (the two run the very same kernels).
        Method("cudnn-again", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION), stock),
    ]


def default_method(openwam_method):
    """openwam_sdpa as shipped: an openwam Method's call with no OPENWAM_SDPA_* variable set
    (the paired timing's contender)."""
    unset = {k: None for k in ("OPENWAM_SDPA_PAD", "OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_CHECK_FINITE")}
    return Method("openwam-default", lambda: env_vars(**unset), openwam_method.call,
                  explain=openwam_method.explain)


METHOD_NAMES = ("cudnn", "efficient", "flash", "pad-fwd", "openwam-auto", "openwam-always", "openwam-never",
                "cudnn-again")

# --------------------------------------------------------------------------- inputs


def make_inputs(shape, layout, device, seed):
    """Random leaves q, k, v (requires_grad), grad of the output and the bool mask (or None)."""
    torch.manual_seed(seed)
    b, h, d, sq, skv = shape.b, shape.h, shape.d, shape.sq, shape.skv

    def rand(s):  # [B,H,S,D] view of storage in `layout`
        size = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return torch.randn(size, device=device, dtype=DTYPE)

    leaves = [rand(sq), rand(skv), rand(skv)]
    for t in leaves:
        t.requires_grad_(True)
    grad = to_bhsd(rand(sq), layout)
    mask = None
    if shape.mask is not None:
        # key padding: each batch element keeps its first L_b keys, 1 <= L_b < Skv
        lengths = torch.randint(max(1, skv // 2), skv, (b,), device=device)
        keep = torch.arange(skv, device=device)[None, :] < lengths[:, None]
        mask = keep[:, None, None, :].expand(shape.mask_shape()).contiguous()
    return leaves, grad, mask


def to_bhsd(t, layout):
    return t.transpose(1, 2) if layout == "bshd" else t


# ---------------------------------------------------------------------- measurement


def percentile(xs, p):
    xs = sorted(xs)
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(ms):
    return {
        "median_ms": percentile(ms, 50),
        "p10_ms": percentile(ms, 10),
        "p90_ms": percentile(ms, 90),
        "min_ms": min(ms),
        "n": len(ms),
    }


def time_ms(fn, warmup, repeats, setup=None):
    """Time fn(setup()) with CUDA events around each call (setup is untimed); host clock on CPU."""
    cuda = torch.cuda.is_available()
    marks = []
    for i in range(warmup + repeats):
        arg = setup() if setup else None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            mark = (start, end)
        else:
            t0 = time.perf_counter()
            fn(arg)
            mark = (time.perf_counter() - t0) * 1e3
        del arg
        if i >= warmup:
            marks.append(mark)
    if cuda:
        torch.cuda.synchronize()
        marks = [s.elapsed_time(e) for s, e in marks]
    return stats(marks)


# About 50 ms of spinning on an H200 (1.98 GHz): longer than the host needs to
# enqueue the repeats of one timing, so the GPU never waits for the host.
SPIN_CYCLES = 100_000_000


def time_ms_device(fn, warmup, repeats, setup=None):
    """Device time of each fn(setup()) with the host kept ahead of the GPU.

    A spin kernel (torch.cuda._sleep) holds the stream while every repeat is
    enqueued, so each event pair brackets only that call's kernels (setup's
    kernels run before the start event): the host's launch overhead, which
    time_ms includes when a call is shorter than its launches, is left out.
    Also returns host_us, the host's mean time per repeat (setup included),
    and, without a setup, gap_us: the longest GPU idle time between calls
    (about 0 when the spin covered the enqueueing; larger means the figure
    still holds host time).
    """
    for _ in range(warmup):
        fn(setup() if setup else None)
    torch.cuda.synchronize()
    marks = []
    torch.cuda._sleep(SPIN_CYCLES)
    t0 = time.perf_counter()
    for _ in range(repeats):
        arg = setup() if setup else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        marks.append((start, end))
        del arg
    host_us = (time.perf_counter() - t0) / repeats * 1e6
    torch.cuda.synchronize()
    out = stats([s.elapsed_time(e) for s, e in marks])
    out["host_us"] = host_us
    if setup is None:
        out["gap_us"] = max((e.elapsed_time(s) * 1e3 for (_, e), (s, _) in zip(marks, marks[1:])),
                            default=0.0)
    return out


def peak_mib(fn):
    """Peak memory allocated by fn() above what was allocated before it (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MiB


def storage_key(t):
    s = t.untyped_storage()
    return (str(s.device), s.data_ptr()), s.nbytes()


def saved_bytes(fwd, leaves, mask):
    """Bytes of the unique storages autograd saves during fwd() (total / beyond q,k,v / new)."""
    seen = {}

    def pack(t):
        key, nbytes = storage_key(t)
        seen[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fwd()
    inputs = {storage_key(t)[0] for t in leaves}
    held = inputs | {storage_key(out)[0]} | ({storage_key(mask)[0]} if mask is not None else set())
    del out
    return {
        "total_bytes": sum(seen.values()),
        "beyond_inputs_bytes": sum(n for k, n in seen.items() if k not in inputs),
        "new_bytes": sum(n for k, n in seen.items() if k not in held),
        "storages": len(seen),
    }


def jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def all_finite(tensors):
    return bool(all(torch.isfinite(t).all().item() for t in tensors))


def step_fns(method, leaves, grad, mask, layout):
    """(fwd, bwd): fwd() runs the method's forward on the inputs, bwd(out) the gradient call."""

    def fwd():
        q, k, v = (to_bhsd(t, layout) for t in leaves)
        return method.call(q, k, v, mask)

    def bwd(out):
        torch.autograd.grad(out, leaves, grad)

    return fwd, bwd


def measure(method, leaves, grad, mask, layout, ref_out, warmup, repeats):
    """Every figure for one method on one input set; errors are recorded in rec["error"]."""
    if method.no_mask_only and mask is not None:
        return {"skipped": f"{method.name} takes no mask"}
    fwd, bwd = step_fns(method, leaves, grad, mask, layout)
    rec = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with method.context():
                if method.explain is not None:
                    rec["explain"] = explain(method, leaves, mask, layout)
                out = fwd()
                grads = torch.autograd.grad(out, leaves, grad)
                rec["finite"] = all_finite([out, *grads])
                if ref_out is not None:
                    rec["fwd_equal_cudnn"] = bool(torch.equal(out, ref_out))
                    rec["fwd_max_abs_diff"] = (out.float() - ref_out.float()).abs().max().item()
                del out, grads
                rec["saved"] = saved_bytes(fwd, leaves, mask)
                rec["peak_mib"] = peak_mib(lambda: bwd(fwd()))
                rec["fwd"] = time_ms(lambda _: fwd(), warmup, repeats)
                if torch.cuda.is_available():
                    rec["fwd_dev"] = time_ms_device(lambda _: fwd(), warmup, repeats)
                    rec["bwd_dev"] = time_ms_device(bwd, warmup, repeats, setup=fwd)
                    rec["fwdbwd_dev"] = time_ms_device(lambda _: bwd(fwd()), warmup, repeats)
                rec["bwd"] = time_ms(bwd, warmup, repeats, setup=fwd)
                rec["fwdbwd"] = time_ms(lambda _: bwd(fwd()), warmup, repeats)
        except Exception as e:  # noqa: BLE001 - record and go on
            rec["error"] = f"{type(e).__name__}: {e}"[:600]
    msgs = sorted({str(w.message)[:300] for w in caught})
    if msgs:
        rec["warnings"] = msgs
    return rec


def per_round_stats(ratios):
    return {"median": percentile(ratios, 50), "min": min(ratios), "max": max(ratios)}


def paired(contenders, leaves, grad, mask, layout, ref_out, rounds, warmup, repeats):
    """Interleaved device timings: each contender's ratio to the first, per round, then the median.

    Each round times every contender's forward and forward+backward (time_ms_device), the order
    rotating from round to round, so drift of clocks and temperature over the run, which separate
    per-method timings absorb into their ratios, falls on all contenders alike. The contenders are
    stock cuDNN, openwam_sdpa at default settings and stock cuDNN again (the A/A control).
    """
    fns = [(m, *step_fns(m, leaves, grad, mask, layout)) for m in contenders]
    out = {"rounds": rounds, "repeats": repeats, "fwd_equal_cudnn": {}, "ratios": {}}
    for m, fwd, _ in fns[1:]:
        with m.context():
            out["fwd_equal_cudnn"][m.name] = ref_out is not None and bool(torch.equal(fwd(), ref_out))
            if m.explain is not None:
                out["explain"] = explain(m, leaves, mask, layout)
    runs = {m.name: {"fwd": [], "fwdbwd": [], "fwd_host_us": []} for m in contenders}
    for r in range(rounds):
        shift = r % len(fns)
        for m, fwd, bwd in fns[shift:] + fns[:shift]:
            with m.context():
                t = time_ms_device(lambda _: fwd(), warmup, repeats)
                runs[m.name]["fwd"].append(t["median_ms"])
                runs[m.name]["fwd_host_us"].append(t["host_us"])
                runs[m.name]["fwdbwd"].append(
                    time_ms_device(lambda _: bwd(fwd()), warmup, repeats)["median_ms"])
    base = contenders[0].name
    out["ms"] = runs
    for m in contenders[1:]:
        out["ratios"][m.name] = {}
        for key in ("fwd", "fwdbwd", "fwd_host_us"):
            out["ratios"][m.name][key] = per_round_stats(
                [a / b for a, b in zip(runs[m.name][key], runs[base][key])])
    return out


def explain(method, leaves, mask, layout):
    """method.explain() on the benchmark inputs as a JSON-safe dict; a failure is recorded, not raised."""
    try:
        return jsonable(method.explain(*(to_bhsd(t, layout) for t in leaves), mask))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def reference_out(methods, leaves, mask, layout):
    """Stock cuDNN forward output in grad mode (detached), or None if it fails."""
    base = next(m for m in methods if m.name == BASE)
    try:
        with base.context():
            return base.call(*(to_bhsd(t, layout) for t in leaves), mask).detach()
    except Exception:  # noqa: BLE001 - the cudnn record will carry the error
        return None


def run_case(shape, layout, methods, contenders, seed, args):
    """Measure all methods (then the paired contenders) on one shape x layout; frees its memory."""
    case = new_case(shape, layout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        leaves, grad, mask = make_inputs(shape, layout, device, seed)
        ref = reference_out(methods, leaves, mask, layout)
        for m in methods:
            case["methods"][m.name] = measure(m, leaves, grad, mask, layout, ref, args.warmup, args.repeats)
        if contenders and args.paired_rounds > 0:
            try:
                case["paired"] = paired(contenders, leaves, grad, mask, layout, ref, args.paired_rounds,
                                        args.warmup, args.paired_repeats)
            except Exception as e:  # noqa: BLE001 - record and go on
                case["paired"] = {"error": f"{type(e).__name__}: {e}"[:600]}
        del leaves, grad, mask, ref
    except Exception as e:  # noqa: BLE001 - e.g. out of memory building inputs
        case["error"] = f"{type(e).__name__}: {e}"[:600]
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a sticky CUDA error; later cases will record it too
        case["cleanup_error"] = f"{type(e).__name__}: {e}"[:300]
    add_ratios(case)
    return case


def new_case(shape, layout):
    return {"shape": asdict(shape), "label": shape.label(), "mask": shape.mask_label(),
            "mask_shape": shape.mask_shape(), "layout": layout, "methods": {}}


# ------------------------------------------------------------------ ratios / summary


def metric(rec, key):
    """A method record's figure: "fwd"/"bwd"/"fwdbwd" median ms (with "_dev": device time),
    "host" us per forward call, "peak" MiB, "saved" bytes beyond inputs."""
    if not rec or "error" in rec or "skipped" in rec:
        return None
    if key == "host":
        return (rec.get("fwd_dev") or {}).get("host_us")
    if key == "peak":
        return rec.get("peak_mib")
    if key == "saved":
        return (rec.get("saved") or {}).get("beyond_inputs_bytes")
    return (rec.get(key) or {}).get("median_ms")


RATIO_KEYS = ("fwd", "fwd_dev", "host", "bwd", "bwd_dev", "fwdbwd", "fwdbwd_dev", "peak", "saved")


def ratio(a, b):
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def add_ratios(case):
    base = case["methods"].get(BASE)
    for rec in case["methods"].values():
        if "error" not in rec and "skipped" not in rec:
            rec["ratios"] = {k: ratio(metric(rec, k), metric(base, k)) for k in RATIO_KEYS}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(cases, name):
    """Geomean / max ratios of one method over all cases, and forward bit-identity count."""
    rows = [(c, c["methods"].get(name, {})) for c in cases]
    ok = [(c, r) for c, r in rows if r.get("ratios")]

    def worst(key):
        vals = [(r["ratios"][key], case_name(c)) for c, r in ok if r["ratios"].get(key) is not None]
        return max(vals) if vals else (None, None)

    fb = [r["ratios"]["fwdbwd"] for _, r in ok if r["ratios"]["fwdbwd"]]
    fb_dev = [r["ratios"]["fwdbwd_dev"] for _, r in ok if r["ratios"].get("fwdbwd_dev")]
    eq = [r["fwd_equal_cudnn"] for _, r in rows if "fwd_equal_cudnn" in r]
    out = {"cases": len(rows), "measured": len(ok), "errors": sum("error" in r for _, r in rows),
           "geomean_fwdbwd_ratio": geomean(fb), "geomean_fwdbwd_dev_ratio": geomean(fb_dev),
           "fwd_bit_identical": f"{sum(eq)}/{len(eq)}"}
    for key in ("fwdbwd", "fwdbwd_dev", "fwd", "fwd_dev", "host", "bwd", "bwd_dev", "peak"):
        out[f"max_{key}_ratio"], out[f"max_{key}_case"] = worst(key)
    return out


def case_name(c):
    return f'{c["label"]} {c["mask"]} {c["layout"]}'


PAIRED_NAMES = ("openwam-default", "cudnn-again")  # the paired timing's contenders after stock cuDNN


def paired_ratio(case, name, key):
    """A case's paired median ratio of contender `name` ("fwd", "fwdbwd" or "fwd_host_us"), or None."""
    r = ((case.get("paired") or {}).get("ratios") or {}).get(name)
    return r[key]["median"] if r else None


def summarize_paired(cases):
    """Geomean and max over the cases of each paired contender's median ratios to stock cuDNN."""
    out = {}
    for name in PAIRED_NAMES:
        entry = {"measured": sum(paired_ratio(c, name, "fwd") is not None for c in cases)}
        for key in ("fwd", "fwdbwd", "fwd_host_us"):
            vals = [(v, case_name(c)) for c in cases if (v := paired_ratio(c, name, key)) is not None]
            entry[f"geomean_{key}"] = geomean([v for v, _ in vals])
            entry[f"max_{key}"], entry[f"max_{key}_case"] = max(vals) if vals else (None, None)
        out[name] = entry
    eq = [(c.get("paired") or {}).get("fwd_equal_cudnn", {}).get(PAIRED_NAMES[0]) for c in cases]
    out["fwd_bit_identical"] = f"{sum(e is True for e in eq)}/{sum(e is not None for e in eq)}"
    return out


def paired_summary_line(ps):
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    d, aa = ps[PAIRED_NAMES[0]], ps[PAIRED_NAMES[1]]
    return (f"paired device time, openwam_sdpa at default settings / stock cuDNN over {d['measured']} cases: "
            f"forward geomean {f(d['geomean_fwd'])}, max {f(d['max_fwd'])} ({d['max_fwd_case']}); "
            f"fwd+bwd geomean {f(d['geomean_fwdbwd'])}, max {f(d['max_fwdbwd'])} ({d['max_fwdbwd_case']}); "
            f"host time per forward call geomean {f(d['geomean_fwd_host_us'])}, max {f(d['max_fwd_host_us'])}; "
            f"forward bit-identical {ps['fwd_bit_identical']}. A/A control (stock again / stock): forward "
            f"geomean {f(aa['geomean_fwd'])}, max {f(aa['max_fwd'])}; fwd+bwd geomean "
            f"{f(aa['geomean_fwdbwd'])}, max {f(aa['max_fwdbwd'])}")


def summary_line(name, s):
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    return (f"{name}: geomean fwd+bwd ratio {f(s['geomean_fwdbwd_ratio'])} over {s['measured']}/{s['cases']} "
            f"cases; max fwd+bwd {f(s['max_fwdbwd_ratio'])} ({s['max_fwdbwd_case']}); device time: "
            f"geomean fwd+bwd {f(s['geomean_fwdbwd_dev_ratio'])}, max fwd+bwd "
            f"{f(s['max_fwdbwd_dev_ratio'])}, max bwd {f(s['max_bwd_dev_ratio'])}; "
            f"max fwd {f(s['max_fwd_ratio'])} (device time {f(s['max_fwd_dev_ratio'])}, "
            f"host time per call {f(s['max_host_ratio'])}); max bwd {f(s['max_bwd_ratio'])}; "
            f"max peak-mem {f(s['max_peak_ratio'])}; forward bit-identical to stock cuDNN "
            f"{s['fwd_bit_identical']}; errors {s['errors']}")


# --------------------------------------------------------------------------- output


def cell(rec, key, fmt="{:.2f}"):
    if not rec:
        return ""
    if "skipped" in rec:
        return "—"
    if "error" in rec:
        return "err"
    val = (rec.get("ratios") or {}).get(key)
    return "—" if val is None else fmt.format(val)


def short(name):
    return name.replace("openwam-", "")


def table(cases, methods, key, title, extras=False, host=False):
    """Markdown table: one row per shape x layout, stock cuDNN ms, then ratios to it per method."""
    others = [m for m in methods if m != BASE]
    head = ["shape", "mask", "layout", f"cuDNN {title} ms"] + [short(m) for m in others]
    if extras:
        head += ["auto fwd (device)", "auto peak", "saved MiB cuDNN / auto", "auto plan"]
    if host:
        head += ["host µs/call cuDNN / auto", "max GPU gap µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        ms = c["methods"]
        base = metric(ms.get(BASE), key)
        row = [c["label"], c["mask"], c["layout"], "err" if base is None else f"{base:.3f}"]
        row += [cell(ms.get(m), key) for m in others]
        if extras:
            auto = ms.get("openwam-auto", {})
            mib = [metric(ms.get(m), "saved") for m in (BASE, "openwam-auto")]
            row += [cell(auto, "fwd_dev"), cell(auto, "peak"),
                    " / ".join("—" if x is None else f"{x / MiB:.1f}" for x in mib),
                    str((auto.get("explain") or {}).get("plan", "—"))]
        if host:
            us = [metric(ms.get(m), "host") for m in (BASE, "openwam-auto")]
            gaps = [r["fwd_dev"]["gap_us"] for r in ms.values() if "fwd_dev" in r]
            row += [" / ".join("—" if x is None else f"{x:.0f}" for x in us),
                    f"{max(gaps):.1f}" if gaps else "—"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def paired_table(cases):
    """Markdown table of the paired timing: per-round ratios' median [min-max] per contender."""
    head = ["shape", "mask", "layout", "cuDNN fwd device ms", "default fwd", "A/A fwd",
            "cuDNN fwd+bwd device ms", "default fwd+bwd", "A/A fwd+bwd", "fwd host µs/call cuDNN / default",
            "default plan", "fwd bit-identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        pr = c.get("paired")
        if not pr:
            continue
        row = [c["label"], c["mask"], c["layout"]]
        if "error" in pr:
            lines.append("| " + " | ".join(row + ["err"] * (len(head) - 3)) + " |")
            continue
        for key in ("fwd", "fwdbwd"):
            row.append(f'{percentile(pr["ms"][BASE][key], 50):.3f}')
            for name in PAIRED_NAMES:
                r = pr["ratios"][name][key]
                row.append(f'{r["median"]:.3f} [{r["min"]:.2f}–{r["max"]:.2f}]')
        host = [percentile(pr["ms"][n]["fwd_host_us"], 50) for n in (BASE, PAIRED_NAMES[0])]
        row.append(" / ".join(f"{x:.0f}" for x in host))
        ex = pr.get("explain") or {}
        row += [f'{ex.get("plan", "—")} ({ex.get("backend", "—")})',
                "yes" if pr["fwd_equal_cudnn"].get(PAIRED_NAMES[0]) else "NO"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(result):
    st, cases, methods = result["stack"], result["cases"], result["settings"]["methods"]
    s = st["settings"]
    parts = [
        f"### SDPA benchmark: {st['gpu']}, torch {st['torch']}, cuDNN {st['cudnn']}, {st['date'][:10]}",
        "",
        f"bf16, training (inputs require grad). Median of {s['repeats']} CUDA-event timings after "
        f"{s['warmup']} warm-up calls. Ratios are to stock cuDNN (`sdpa_kernel(CUDNN_ATTENTION)`) on "
        "the same shape and layout; lower is better. Methods: efficient / flash = stock "
        "F.sdpa backends (flash: no mask only, — elsewhere); pad-fwd = pad K/V and mask before the "
        "forward, then stock cuDNN; auto / always / never = openwam_sdpa with OPENWAM_SDPA_PAD=that "
        "and OPENWAM_SDPA_CUDNN=1. bshd = [B,S,H,D] storage viewed as [B,H,S,D]; bhsd = contiguous. "
        "cudnn-again = stock cuDNN measured a second time, after the others: its distance from 1.00 "
        "is the noise floor of this run. "
        "Bool masks are key-padding masks of the stated shape. "
        "The auto setting's dQ repair kernel is included in its timings.",
        "",
        "**Forward + backward** (auto fwd (device) / auto peak: ratios of forward device time (the "
        "forward device table below) and of peak memory of one fwd+bwd; saved MiB: bytes kept for "
        "backward beyond q, k, v):",
        "",
        table(cases, methods, "fwdbwd", "fwd+bwd", extras=True),
        "",
        "**Summary** (over all shape x layout rows):",
        "",
    ]
    parts += [f"- {summary_line(short(m), result['summary'][m])}" for m in methods if m != BASE]
    parts += ["", "**Backward only:**", "", table(cases, methods, "bwd", "bwd"),
              "", "**Forward only** (grad mode):", "", table(cases, methods, "fwd", "fwd"), ""]
    if any("fwd_dev" in r for c in cases for r in c["methods"].values()):
        parts += ["**Forward device time** (grad mode; all repeats enqueued behind a spin kernel, so "
                  "each event pair holds only the call's kernels and no host launch gap; host µs/call: "
                  "the host's mean time per forward call while enqueueing; max GPU gap: the longest "
                  "idle time between two calls on the GPU over all methods, about 0 when the figures "
                  "are pure device time):", "",
                  table(cases, methods, "fwd_dev", "fwd device", host=True), ""]
    if any("fwdbwd_dev" in r for c in cases for r in c["methods"].values()):
        parts += ["**Forward + backward device time** (the same method: each repeat's forward and "
                  "backward enqueued behind the spin kernel):", "",
                  table(cases, methods, "fwdbwd_dev", "fwd+bwd device"), ""]
    if result.get("paired_summary"):
        st_set = result["settings"]
        parts += [f"**Paired device time** (openwam_sdpa at default settings, no OPENWAM_SDPA_* variable "
                  f"set, against stock cuDNN and stock cuDNN again, the A/A control: "
                  f"{st_set.get('paired_rounds')} rounds, each timing every contender's forward and "
                  f"forward+backward as device time over {st_set.get('paired_repeats')} repeats, the order "
                  "rotating from round to round; each cell is the median over rounds of the per-round "
                  "ratio to stock cuDNN, [min–max] over rounds):", "",
                  paired_table(result["cases"]), "",
                  f"- {paired_summary_line(result['paired_summary'])}", ""]
    return "\n".join(parts)


def plot(result, path):
    """Grouped bars: fwd+bwd time ratio to stock cuDNN per shape x layout and method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: {e}")
        return False
    cases = result["cases"]
    others = [m for m in result["settings"]["methods"] if m != BASE]
    width = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(cases)), 5.5))
    for i, m in enumerate(others):
        ys = [metric_ratio(c, m) for c in cases]
        xs = [j + (i - (len(others) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, [math.nan if y is None else y for y in ys], width, label=short(m))
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ticks = [0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 6, 8]
    lo, hi = ax.get_ylim()
    ax.set_yticks([t for t in ticks if lo <= t <= hi], [f"{t:g}" for t in ticks if lo <= t <= hi])
    ax.minorticks_off()
    ax.set_ylabel("fwd+bwd time / stock cuDNN (log)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c['shape']['sq']}x{c['shape']['skv']} {'mask' if c['shape']['mask'] else 'none'}"
                        f"\nB{c['shape']['b']} D{c['shape']['d']} {c['layout']}" for c in cases],
                       fontsize=7, rotation=45, ha="right")
    st = result["stack"]
    ax.set_title(f"SDPA fwd+bwd vs stock cuDNN — {st['gpu']}, torch {st['torch']}, cuDNN {st['cudnn']}",
                 fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def metric_ratio(case, name):
    return ((case["methods"].get(name) or {}).get("ratios") or {}).get("fwdbwd")


def write_json(result, out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1, default=str))


def write_outputs(result, out_dir):
    write_json(result, out_dir)
    md = markdown(result)
    (out_dir / "bench.md").write_text(md)
    plot(result, out_dir / "bench.png")
    return md


# ---------------------------------------------------------------------------- stack


def git_rev():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def stack_info(ow, ow_error, settings):
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_rev(),
        "openwam_sdpa": getattr(ow, "__version__", None) if ow else None,
        "openwam_sdpa_file": getattr(ow, "__file__", None) if ow else None,
        "openwam_import_error": ow_error,
        "env": {k: v for k, v in os.environ.items() if k.startswith("OPENWAM_")},
        "settings": settings,
    }


# ------------------------------------------------------------------------- selftest


def fake_case(shape, layout, methods, rng):
    """A case with plausible made-up numbers (and one error, flash skips) for --selftest."""
    case = new_case(shape, layout)
    scale = shape.b * shape.h * shape.sq * shape.skv * shape.d / 1.4e9
    for m in methods:
        if m == "flash" and shape.mask:
            case["methods"][m] = {"skipped": "flash takes no mask"}
            continue
        if m == "efficient" and shape.name == "b4_4096x4032_bool" and layout == "bhsd":
            case["methods"][m] = {"error": "RuntimeError: fake failure"}
            continue
        f = 1.0 if m == BASE else rng.uniform(0.9, 3.0)
        timings = {k: stats([scale * w * f * rng.uniform(0.95, 1.1) for _ in range(30)])
                   for k, w in (("fwd", 0.25), ("fwd_dev", 0.24), ("bwd", 0.75), ("bwd_dev", 0.74),
                                ("fwdbwd", 1.0), ("fwdbwd_dev", 0.98))}
        timings["fwd_dev"].update(host_us=rng.uniform(40, 90) * f, gap_us=rng.uniform(0.0, 2.0))
        nbytes = int(shape.b * shape.h * shape.sq * (shape.d * 2 + 4))
        case["methods"][m] = {**timings, "peak_mib": 100 * scale * f, "finite": True,
                              "saved": {"total_bytes": nbytes * 3, "beyond_inputs_bytes": nbytes,
                                        "new_bytes": nbytes // 10, "storages": 6}}
        if m.startswith("openwam"):
            case["methods"][m]["explain"] = {"backend": "cudnn", "plan": "repair_dq"}
        if m != BASE:
            case["methods"][m]["fwd_equal_cudnn"] = m != "pad-fwd"
    rounds = 3
    ms = {n: {k: [scale * w * rng.uniform(0.98, 1.03) for _ in range(rounds)]
              for k, w in (("fwd", 0.24), ("fwdbwd", 0.98), ("fwd_host_us", 400.0 / scale))}
          for n in (BASE, *PAIRED_NAMES)}
    case["paired"] = {
        "rounds": rounds, "repeats": 30, "ms": ms, "fwd_equal_cudnn": {n: True for n in PAIRED_NAMES},
        "explain": {"backend": "cudnn", "plan": "repair_dq"},
        "ratios": {n: {k: per_round_stats([a / b for a, b in zip(ms[n][k], ms[BASE][k])])
                       for k in ("fwd", "fwdbwd", "fwd_host_us")} for n in PAIRED_NAMES}}
    add_ratios(case)
    return case


def selftest(args):
    """Run the output path (ratios, summary, JSON, markdown, PNG) on fake numbers; no GPU needed."""
    rng = random.Random(0)
    shapes, layouts, methods = select(args)
    settings = {"repeats": args.repeats, "warmup": args.warmup, "methods": methods, "selftest": True,
                "paired_rounds": 3, "paired_repeats": 30,
                "shapes": [s.name for s in shapes], "layouts": layouts}
    cases = [fake_case(s, lay, methods, rng) for s in shapes for lay in layouts]
    result = finish(stack_info(None, "selftest", settings), settings, cases)
    out = Path(args.out)
    md = write_outputs(result, out)
    back = json.loads((out / "bench.json").read_text())
    assert len(back["cases"]) == len(shapes) * len(layouts)
    assert md.count("\n| B") == 6 * len(back["cases"]), "one table row per case in each of 6 tables"
    assert back["paired_summary"]["openwam-default"]["measured"] == len(back["cases"])
    assert "matplotlib" not in sys.modules or (out / "bench.png").stat().st_size > 1000
    print(md)
    print(f"selftest OK: wrote {out}/bench.json, bench.md, bench.png")


# ----------------------------------------------------------------------------- main


def select(args):
    """Shapes, layouts and method names chosen by the command line."""
    shapes = [s for s in SHAPES if not args.quick or s.name in QUICK_SHAPES]
    if args.shapes:
        keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
        shapes = [s for s in shapes if any(k in s.name for k in keys)]
    layouts = ["bshd"] if args.quick else list(LAYOUTS)
    if args.layouts:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    picked = {m.strip() for m in args.methods.split(",") if m.strip()} | {BASE} if args.methods else set(METHOD_NAMES)
    methods = [m for m in METHOD_NAMES if m in picked]
    bad = [x for x in layouts if x not in LAYOUTS] + sorted(picked - set(METHOD_NAMES))
    if bad or not shapes:
        raise SystemExit(f"unknown layout/method {bad}" if bad else f"no shape matches {args.shapes!r}")
    return shapes, layouts, methods


def finish(stack, settings, cases):
    summary = {m: summarize(cases, m) for m in settings["methods"] if m != BASE}
    result = {"stack": stack, "settings": settings, "summary": summary, "cases": cases}
    if any("paired" in c for c in cases):
        result["paired_summary"] = summarize_paired(cases)
    return result


def progress(i, n, case, t0):
    ms = case["methods"]
    base = metric(ms.get(BASE), "fwdbwd")
    parts = [f"{short(m)} {cell(r, 'fwdbwd')}" for m, r in ms.items() if m != BASE]
    print(f"[{i}/{n}] {case['label']} {case['mask']} {case['layout']}: cuDNN fwd+bwd "
          f"{'err' if base is None else f'{base:.3f} ms'} | " + ", ".join(parts)
          + f" | {time.time() - t0:.0f}s", flush=True)
    for m, r in ms.items():
        if "error" in r:
            print(f"    {m}: {r['error'][:200]}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="shapes: " + ", ".join(s.name for s in SHAPES))
    p.add_argument("--out", default=str(HERE / "out"), help="output folder (default: benchmarks/out)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default 50, --quick 25)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SHAPES)}, bshd layout")
    p.add_argument("--shapes", help="comma-separated substrings of shape names, e.g. 392,4096")
    p.add_argument("--layouts", help="comma-separated subset of bshd,bhsd")
    p.add_argument("--methods", help="comma-separated subset of " + ",".join(METHOD_NAMES) + " (cudnn always runs)")
    p.add_argument("--paired-rounds", type=int, default=6,
                   help="rounds of the paired stock / openwam-default / stock-again device timing (0: skip)")
    p.add_argument("--paired-repeats", type=int, default=30, help="timed repeats per contender and round")
    p.add_argument("--selftest", action="store_true", help="write outputs from fake numbers; needs no GPU")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 25 if args.quick else 50
    if args.repeats < 1 or args.warmup < 0 or args.paired_rounds < 0 or args.paired_repeats < 1:
        p.error("--repeats and --paired-repeats must be >= 1, --warmup and --paired-rounds >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.selftest:
        return selftest(args)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --selftest to check the output path without a GPU")
    shapes, layouts, names = select(args)
    ow, ow_error = import_openwam()
    every = {m.name: m for m in build_methods(ow, ow_error)}
    methods = [m for m in every.values() if m.name in names]
    contenders = [every[BASE], default_method(every["openwam-auto"]), every["cudnn-again"]]
    settings = {"repeats": args.repeats, "warmup": args.warmup, "methods": names, "dtype": "bfloat16",
                "paired_rounds": args.paired_rounds, "paired_repeats": args.paired_repeats,
                "shapes": [s.name for s in shapes], "layouts": layouts, "quick": args.quick}
    stack = stack_info(ow, ow_error, settings)
    print(f"{stack['gpu']} torch {stack['torch']} cuDNN {stack['cudnn']} openwam_sdpa "
          f"{stack['openwam_sdpa_file'] or 'NOT IMPORTED: ' + str(ow_error)}", flush=True)
    t0, cases = time.time(), []
    jobs = [(s, lay) for s in shapes for lay in layouts]
    for i, (shape, layout) in enumerate(jobs, 1):
        cases.append(run_case(shape, layout, methods, contenders, 1000 + SHAPES.index(shape), args))
        progress(i, len(jobs), cases[-1], t0)
        write_json({**finish(stack, settings, cases), "partial": True}, Path(args.out))
    result = finish(stack, settings, cases)
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    md = write_outputs(result, Path(args.out))
    print()
    print(md)
    print(summary_line("openwam auto", result["summary"].get("openwam-auto") or summarize(cases, "openwam-auto")))
    if result.get("paired_summary"):
        print(paired_summary_line(result["paired_summary"]))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
