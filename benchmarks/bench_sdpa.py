"""The op benchmark: openwam_sdpa at default settings against stock F.sdpa (bf16, training).

Contenders: stock F.scaled_dot_product_attention with PyTorch's own backend choice
(cuDNN on H100/H200 with torch 2.11+), openwam_sdpa.sdpa with no OPENWAM_SDPA_*
variable set, and stock again, the A/A control: its distance from 1 is the
run's noise floor. Inputs are [B,S,H,D] storage seen as [B,H,S,D], what a model
hands over. Sections (--sections; all by default):

  paired       ordinary random inputs on the op shapes and OpenWAM's (joint 392x392,
               text cross-attention 360x64 and 32x64): forward and forward+backward
               device time in paired rounds; per shape the median of the per-round
               ratios to stock, over shapes their geomean and the worst.
  adversarial  openwam_sdpa.adversarial inputs on affected key lengths, with no row,
               one row per (b,h), 10% and every row affected, without and with a bool
               mask: paired forward+backward ratio, and the non-finite gradient
               elements of stock and of openwam_sdpa after one backward.
  host         host time per forward call and per backward call (the autograd node
               called directly, as the engine calls it) while a spin kernel holds the
               GPU, in paired rounds: openwam_sdpa minus stock, µs.
  first_call   wall time of the first forward+backward of a shape the process has not
               seen (plans and graphs built then), each contender on its own new batch
               size in every round, after a warm-up on another shape.
  memory       peak memory of one forward+backward above the inputs, on the paired
               shapes and with [B,H,S,S] masks of 8192 tokens.

timing.py says how each clock works. Failures are recorded, not raised; nothing is
asserted about timing.

    python benchmarks/bench_sdpa.py --quick --out $OUT/sdpa       # about 2 minutes on an H200 (estimated)
    python benchmarks/bench_sdpa.py --out $OUT/sdpa               # every shape, more rounds
    python benchmarks/bench_sdpa.py --sections paired,host --shapes openwam
    python benchmarks/bench_sdpa.py --render $OUT/sdpa/sdpa.json  # the tables of an earlier run
    python benchmarks/bench_sdpa.py --selftest --out /tmp/sdpa    # CPU, tiny shapes, checks the outputs
Writes sdpa.json (every raw figure) and sdpa.md (the tables) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import report
import timing
from report import DASH, num, spread
from stack import headline, import_openwam, openwam_settings, require_device, stack_info

DTYPE = torch.bfloat16
BASE, OPENWAM, AGAIN = "stock", "openwam", "stock-again"
SECTIONS = ("paired", "adversarial", "host", "first_call", "memory")

# ---------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call. mask: none; padding = bool key padding [B,1,Sq,Skv]; keys = the
    same as [B,1,1,Skv]; joint = OpenWAM's video/action mask [B,1,S,S] (the last twelfth of
    the queries, the action tokens, see every key; the others see the video keys only);
    causal / additive = [B,H,S,S] materialised (bool / random in bf16); causal-view = causal
    [1,1,S,S] expanded to [B,H,S,S] (stride 0)."""

    name: str
    b: int
    h: int
    d: int
    sq: int
    skv: int
    mask: str = "none"

    def label(self):
        return f"B{self.b} H{self.h} D{self.d} {self.sq}x{self.skv}"


PAIRED = [
    Case("b32_392x392_none", 32, 24, 128, 392, 392),
    Case("b32_392x392_padding", 32, 24, 128, 392, 392, "padding"),
    Case("b32_360x64_padding", 32, 24, 128, 360, 64, "padding"),
    Case("b16_704x704_none", 16, 24, 128, 704, 704),
    Case("b16_704x704_padding", 16, 24, 128, 704, 704, "padding"),
    Case("b32_392x392_d64_padding", 32, 24, 64, 392, 392, "padding"),
    Case("b4_4096x4000_none", 4, 24, 128, 4096, 4000),
    Case("b4_4096x4032_keys", 4, 24, 128, 4096, 4032, "keys"),
    Case("b16_512x512_padding", 16, 24, 128, 512, 512, "padding"),
    Case("openwam_joint_392", 32, 24, 128, 392, 392, "joint"),
    Case("openwam_text_360x64", 32, 24, 128, 360, 64, "keys"),
    Case("openwam_text_32x64", 32, 24, 128, 32, 64, "keys"),
]
# Key lengths where cuDNN 9.19's backward writes NaN (s_kv % 128 == 64); each without and with a mask.
ADVERSARIAL = [Case(f"{name}_{mask}", b, 24, 128, sq, skv, mask)
               for name, b, sq, skv in (("b32_360x64", 32, 360, 64), ("b16_704x704", 16, 704, 704),
                                        ("b4_4096x4032", 4, 4096, 4032))
               for mask in ("none", "padding")]
SHARES = ("none", "one_per_head", 0.1, "all")
SHARE_LABELS = {"none": "none", "one_per_head": "1 per (b,h)", "0.1": "10%", "all": "all"}
# OpenWAM's three calls at batch 4, where host time weighs most, and a large unmasked one.
HOST = [Case("openwam_joint_b4", 4, 24, 128, 392, 392, "joint"),
        Case("openwam_text_360x64_b4", 4, 24, 128, 360, 64, "keys"),
        Case("openwam_text_32x64_b4", 4, 24, 128, 32, 64, "keys"),
        Case("b32_392x392_none", 32, 24, 128, 392, 392)]
FIRST_CALL = [Case("openwam_joint_b4", 4, 24, 128, 392, 392, "joint"),
              Case("b4_704x704_none", 4, 24, 128, 704, 704),
              Case("b4_4096x4032_keys", 4, 24, 128, 4096, 4032, "keys")]
LONG_MASKS = [Case(f"b1_8192_{m}", 1, 32, 64, 8192, 8192, m) for m in ("causal", "additive", "causal-view")]
QUICK = {"paired": ("b32_392x392_none", "b32_392x392_padding", "b4_4096x4000_none", "openwam_joint_392",
                    "openwam_text_360x64", "openwam_text_32x64"),
         "adversarial": ("b16_704x704_none", "b16_704x704_padding"),
         "first_call": ("openwam_joint_b4",)}

# The selftest's tiny stand-ins: every mask kind, on the CPU in seconds.
TINY = [Case("tiny_24x24_none", 1, 2, 16, 24, 24), Case("tiny_20x8_padding", 2, 2, 16, 20, 8, "padding"),
        Case("tiny_24x40_keys", 1, 2, 16, 24, 40, "keys"), Case("tiny_24x24_joint", 1, 2, 16, 24, 24, "joint")]
TINY_ADVERSARIAL = [Case("tiny_20x8_none", 2, 2, 16, 20, 8), Case("tiny_20x8_padding", 2, 2, 16, 20, 8, "padding")]
TINY_LONG_MASKS = [Case(f"tiny_32_{m}", 1, 2, 16, 32, 32, m) for m in ("causal", "additive", "causal-view")]


def cases_for(section, args):
    """The cases a section runs: --selftest's tiny ones, --quick's few, or every one; then --shapes."""
    if args.selftest:
        chosen = {"adversarial": TINY_ADVERSARIAL, "memory": TINY + TINY_LONG_MASKS, "first_call": TINY[1:2]}.get(
            section, TINY)
    else:
        chosen = {"paired": PAIRED, "adversarial": ADVERSARIAL, "host": HOST, "first_call": FIRST_CALL,
                  "memory": [c for c in PAIRED if not args.quick or c.name in QUICK["paired"]] + LONG_MASKS}[section]
        if args.quick and section in QUICK:
            chosen = [c for c in chosen if c.name in QUICK[section]]
    if args.shapes:
        chosen = [c for c in chosen if any(s in c.name for s in args.shapes)]
    return chosen


# ---------------------------------------------------------------------- inputs


def make_mask(case, device, gen):
    b, h, sq, skv = case.b, case.h, case.sq, case.skv
    if case.mask == "none":
        return None
    if case.mask in ("padding", "keys"):  # batch element i keeps its first L_i keys, skv/2 <= L_i <= skv
        lengths = torch.randint(max(1, skv // 2), skv + 1, (b,), device=device, generator=gen)
        keep = torch.arange(skv, device=device)[None, :] < lengths[:, None]
        return keep[:, None, None, :].expand(b, 1, sq if case.mask == "padding" else 1, skv).contiguous()
    if case.mask == "joint":
        video = sq - sq // 12
        joint = torch.zeros(sq, skv, dtype=torch.bool, device=device)
        joint[:, :video] = True
        joint[video:, :] = True
        return joint.expand(b, 1, sq, skv).contiguous()
    if case.mask == "additive":
        return torch.randn(b, h, sq, skv, device=device, dtype=DTYPE, generator=gen)
    causal = torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
    return causal.expand(b, h, sq, skv) if case.mask == "causal-view" else causal.expand(b, h, sq, skv).contiguous()


def make_inputs(case, device, seed):
    """The leaves q, k, v ([B,S,H,D] storage, requiring grad), the output's gradient ([B,H,S,D] view)
    and the mask, drawn from `seed`."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(s):
        return torch.randn(case.b, s, case.h, case.d, device=device, dtype=DTYPE, generator=gen)

    leaves = [rand(case.sq).requires_grad_(), rand(case.skv).requires_grad_(), rand(case.skv).requires_grad_()]
    return leaves, rand(case.sq).transpose(1, 2), make_mask(case, device, gen)


class ShareInputs:
    """openwam_sdpa.adversarial inputs of one case at any share of affected rows.

    adversarial_inputs() with rows="none" and rows="all" and one seed draw the same keys,
    values and output gradient, and the same low queries for the affected rows, so the query
    of any selection is where(selected, all's, none's): exactly adversarial_inputs(rows=
    selection) (the selftest checks it), two builds per case instead of one per share.
    """

    def __init__(self, adversarial, case, device, seed):
        self.adversarial, self.case, self.seed = adversarial, case, seed
        build = dict(batch=case.b, heads=case.h, s_q=case.sq, s_kv=case.skv, head_dim=case.d,
                     layout="bshd", dtype=DTYPE, device=device, seed=seed)
        self.ordinary = adversarial.adversarial_inputs(**build, rows="none")
        self.low = adversarial.adversarial_inputs(**build, rows="all")
        self.mask = make_mask(case, device, torch.Generator(device=device).manual_seed(seed))

    def select(self, share):
        """([q, k, v] as [B,H,S,D] views requiring grad, the output's gradient, number of affected rows)."""
        c = self.case
        affected = self.adversarial.affected_rows(share, c.b, c.h, c.sq,
                                                  generator=torch.Generator().manual_seed(self.seed + 1))
        sel = affected.to(self.low.query.device)[..., None]
        q = self.adversarial.as_layout(torch.where(sel, self.low.query, self.ordinary.query), "bshd")
        k, v = (t.detach().clone() for t in (self.ordinary.key, self.ordinary.value))
        return [t.requires_grad_() for t in (q, k, v)], self.ordinary.grad_out, int(affected.sum())


# ---------------------------------------------------------------------- contenders


@dataclasses.dataclass
class Contender:
    """attend(q, k, v, mask) -> out, called inside context()."""

    name: str
    attend: Callable
    context: Callable = contextlib.nullcontext


def contenders(ow):
    stock = Contender(BASE, lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return [stock, Contender(OPENWAM, lambda q, k, v, mask: ow.sdpa(q, k, v, attn_mask=mask), openwam_settings),
            timing.again(stock)]


def step_fns(contender, leaves, grad, mask, bshd=True):
    """(fwd, bwd): fwd() runs the forward; bwd(out) the gradient call, returning the grads."""

    def fwd(_=None):
        q, k, v = (t.transpose(1, 2) for t in leaves) if bshd else leaves
        return contender.attend(q, k, v, mask)

    return fwd, lambda out: torch.autograd.grad(out, leaves, grad)


def explain(ow, leaves, mask, bshd=True):
    """openwam_sdpa.explain() of the call, JSON-safe; a failure is recorded, not raised."""
    try:
        q, k, v = (t.transpose(1, 2) for t in leaves) if bshd else leaves
        return json.loads(json.dumps(ow.explain(q, k, v, attn_mask=mask), default=str))
    except Exception as e:  # noqa: BLE001
        return {"error": error_text(e)}


def error_text(e):
    return f"{type(e).__name__}: {e}"[:600]


def nonfinite(tensors):
    return int(sum((~torch.isfinite(t)).sum().item() for t in tensors))


def ratios(runs, keys):
    """Per contender but stock: over_rounds() of its per-round ratio to stock on each key."""
    return {n: {k: timing.round_ratios(runs, n, BASE, k) for k in keys} for n in runs if n != BASE}


def free_memory():
    if timing.cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def recorded(measure):
    """measure(...) -> entry dict, with an exception recorded as entry["error"] and memory freed."""

    def run(case, *rest):
        entry = {"case": dataclasses.asdict(case), "label": case.label()}
        try:
            entry.update(measure(case, *rest))
        except Exception as e:  # noqa: BLE001 - one failed case (out of memory...) must not cost the run
            entry["error"] = error_text(e)
        free_memory()
        return entry

    return run


# ---------------------------------------------------------------------- sections


@recorded
def paired(case, ow, everyone, device, seed, args):
    leaves, grad, mask = make_inputs(case, device, seed)
    fns = {c.name: step_fns(c, leaves, grad, mask) for c in everyone}
    outs = {}
    for c in everyone[:2]:
        with c.context():
            outs[c.name] = fns[c.name][0]().detach()

    def measure(c):
        fwd, bwd = fns[c.name]
        f = timing.device_ms(fwd, args.warmup, args.repeats)
        fb = timing.device_ms((fwd, bwd), args.warmup, args.repeats)
        covered = None if f["covered"] is None else f["covered"] and fb["covered"]
        return {"fwd_ms": f["median_ms"], "fwdbwd_ms": fb["median_ms"], "covered": covered}

    runs = timing.paired_rounds(everyone, measure, args.rounds)
    with openwam_settings():
        decision = explain(ow, leaves, mask)
    return {"decision": decision, "fwd_bit_identical": bool(torch.equal(outs[BASE], outs[OPENWAM])),
            "runs": runs, "ratios": ratios(runs, ("fwd_ms", "fwdbwd_ms"))}


def adversarial_case(case, ow, everyone, device, seed, args):
    """A list of entries, one per share (the inputs built once for all of them)."""
    try:
        inputs = ShareInputs(importlib.import_module("openwam_sdpa.adversarial"), case, device, seed)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, as in every section
        free_memory()
        return [{"case": dataclasses.asdict(case), "label": case.label(), "error": error_text(e)}]
    cells = [share_cell(case, ow, everyone, inputs, share, args) for share in SHARES]
    del inputs
    free_memory()
    return cells


@recorded
def share_cell(case, ow, everyone, inputs, share, args):
    leaves, grad, affected = inputs.select(share)
    fns = {c.name: step_fns(c, leaves, grad, inputs.mask, bshd=False) for c in everyone}
    cell = {"share": str(share), "affected_rows": affected, "nonfinite": {}}
    slowest = 0.0
    for c in everyone[:2]:
        fwd, bwd = fns[c.name]
        with c.context():
            cell["nonfinite"][c.name] = dict(zip(("dq", "dk", "dv"), (nonfinite([g]) for g in bwd(fwd()))))
            slowest = max(slowest, timing.once_ms(lambda: bwd(fwd())))
    with openwam_settings():
        cell["decision"] = explain(ow, leaves, inputs.mask, bshd=False)
    # About args.round_ms of calls per contender and round: fewer repeats where a share is slow.
    repeats = max(3, min(args.repeats, int(args.round_ms / max(slowest, 1e-3))))

    def measure(c):
        t = timing.device_ms(tuple(fns[c.name]), 1, repeats)
        return {"fwdbwd_ms": t["median_ms"], "covered": t["covered"]}

    runs = timing.paired_rounds(everyone, measure, args.rounds)
    return {**cell, "repeats": repeats, "runs": runs, "ratios": ratios(runs, ("fwdbwd_ms",))}


@recorded
def host(case, ow, everyone, device, seed, args):
    """Host µs per call of each contender's forward and of its backward node, every result kept
    until the timing ends (no call pays for freeing the last one's output and graph)."""
    leaves, grad, mask = make_inputs(case, device, seed)
    fns = {c.name: step_fns(c, leaves, grad, mask) for c in everyone}
    nodes = {}
    for c in everyone:
        with c.context():
            fns[c.name][0]()  # warm-up: plans built, memory cached
            nodes[c.name] = fns[c.name][0]().grad_fn

    def measure(c):
        fwd = timing.call_host_us(fns[c.name][0], args.warmup, args.repeats)
        with torch.no_grad():  # the engine calls a node with grad mode off
            bwd = timing.call_host_us(lambda: nodes[c.name](grad), args.warmup, args.repeats)
        covered = None if fwd["covered"] is None else fwd["covered"] and bwd["covered"]
        return {"fwd_us": fwd["us"], "bwd_us": bwd["us"], "covered": covered}

    runs = timing.paired_rounds(everyone, measure, args.rounds)
    with openwam_settings():
        decision = explain(ow, leaves, mask)
    keys = ("fwd_us", "bwd_us")
    return {"decision": decision, "runs": runs, "ratios": ratios(runs, keys),
            "deltas": {n: {k: timing.round_deltas(runs, n, BASE, k) for k in keys} for n in runs if n != BASE}}


@recorded
def first_call(case, ow, everyone, device, seed, args):
    """Each contender, in every round, on a batch size no call of this process has had: a shape
    new to every cache (PyTorch's cuDNN graphs, cuDNN's heuristics, openwam_sdpa's plans). The
    warm-up on the case's own batch size leaves only the per-shape work to the first call."""
    for c in everyone:
        leaves, grad, mask = make_inputs(case, device, seed)
        fwd, bwd = step_fns(c, leaves, grad, mask)
        with c.context():
            timing.once_ms(lambda: bwd(fwd()))
    batches = iter(range(case.b + 1, case.b + 1 + len(everyone) * args.first_rounds))

    def measure(c):
        new = dataclasses.replace(case, b=next(batches))
        leaves, grad, mask = make_inputs(new, device, seed)
        fwd, bwd = step_fns(c, leaves, grad, mask)
        first = timing.once_ms(lambda: bwd(fwd()))
        second = timing.once_ms(lambda: bwd(fwd()))
        # The batch grows by one each call (a shape new to every cache), so a
        # long run's first calls are mostly steady compute; the first call over
        # the second on the same shape is what the new shape costs beyond it.
        return {"batch": new.b, "first_ms": first, "second_ms": second,
                "first_over_second": first / second}

    runs = timing.paired_rounds(everyone, measure, args.first_rounds)
    return {"runs": runs, "ratios": ratios(runs, ("first_ms", "second_ms", "first_over_second"))}


@recorded
def memory(case, ow, everyone, device, seed, args):
    leaves, grad, mask = make_inputs(case, device, seed)
    entry = {"mask_mib": None if mask is None else mask.untyped_storage().nbytes() / 2.0**20, "peak_mib": {},
             "finite": {}}
    for c in everyone[:2]:
        fwd, bwd = step_fns(c, leaves, grad, mask)
        with c.context():
            out = fwd()
            entry["finite"][c.name] = nonfinite([out, *bwd(out)]) == 0
            del out
            entry["peak_mib"][c.name] = timing.peak_mib(lambda: bwd(fwd()))
    with openwam_settings():
        entry["decision"] = explain(ow, leaves, mask)
    return entry


MEASURE = {"paired": paired, "adversarial": adversarial_case, "host": host, "first_call": first_call,
           "memory": memory}


def run(args):
    device = "cuda" if timing.cuda() else "cpu"
    ow, ow_error = import_openwam()
    if ow is None:
        raise SystemExit(f"openwam_sdpa is not importable: {ow_error}")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "render")}
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings}
    print(headline(result["stack"]), flush=True)
    everyone, t0 = contenders(ow), time.time()
    for section in args.sections:
        entries = result[section] = []
        chosen = cases_for(section, args)
        for i, case in enumerate(chosen, 1):
            got = MEASURE[section](case, ow, everyone, device, 1000 * (SECTIONS.index(section) + 1) + i, args)
            entries.extend(got if isinstance(got, list) else [got])
            print(f"[{section} {i}/{len(chosen)}] {case.label()} {case.mask}: {progress(section, entries[-1])}"
                  f" | {time.time() - t0:.0f}s", flush=True)
            report.write_json({**result, "partial": True}, args.out, "sdpa")
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return result


def progress(section, entry):
    if "error" in entry:
        return "ERROR " + entry["error"][:200]
    if section == "memory":
        return "peak MiB " + ", ".join(f"{n} {num(v, '{:.0f}')}" for n, v in entry["peak_mib"].items())
    if section == "host":
        return ", ".join(f"{k} {delta(k)(entry)}" for k in ("fwd_us", "bwd_us")) + " µs"
    key = {"first_call": "first_ms"}.get(section, "fwdbwd_ms")
    return f"{key} openwam / stock {spread(entry['ratios'][OPENWAM][key])}, A/A {spread(entry['ratios'][AGAIN][key])}"


# ---------------------------------------------------------------------- report


def median_of(entry, name, key):
    values = entry["runs"][name][key]
    return None if None in values else timing.percentile(values, 50)


def summary(entries, key, name=OPENWAM):
    """The geomean and the worst (largest) over cases of the median per-round ratio to stock."""
    vals = [(e["ratios"][name][key]["median"], f"{e['label']} {e['case']['mask']}") for e in entries
            if "ratios" in e and e["ratios"][name][key]]
    if not vals:
        return {"geomean": None, "worst": None, "worst_case": None, "cases": 0}
    worst = max(vals)
    return {"geomean": timing.geomean([v for v, _ in vals]), "worst": worst[0], "worst_case": worst[1],
            "cases": len(vals)}


def summary_line(what, s):
    return (f"- {what}: geomean {num(s['geomean'])}, worst {num(s['worst'])} ({s['worst_case'] or DASH}) "
            f"over {s['cases']} shapes")


# Table cells: stock's median figure, a contender's ratio or difference to stock, and so on.
def ms(key, spec="{:.3f}", name=BASE):
    return lambda e: num(median_of(e, name, key), spec)


def ratio(key, name=OPENWAM):
    return lambda e: spread(e["ratios"][name][key])


def delta(key, name=OPENWAM):
    return lambda e: (lambda d: DASH if d is None else f"{d['median']:+.1f} [{d['min']:+.0f}–{d['max']:+.0f}]")(
        e["deltas"][name][key])


def plan(e):
    d = e.get("decision") or {}
    return f"{d.get('plan', DASH)} ({d.get('backend', DASH)}; stock: {d.get('pytorch_choice', DASH)})"


def table(entries, columns):
    """A row per entry: its shape and mask, then each column's cell; a failed entry's row says why."""
    rows = [[e["label"], e["case"]["mask"]]
            + ([e["error"][:80]] + [DASH] * (len(columns) - 1) if "error" in e else [cell(e) for _, cell in columns])
            for e in entries]
    return report.md_table(["shape", "mask"] + [title for title, _ in columns], rows)


def nonfinite_cell(e):
    return " / ".join(str(sum(e["nonfinite"][n].values())) for n in (BASE, OPENWAM))


def memory_cells(e):
    a, b = e["peak_mib"][OPENWAM], e["peak_mib"][BASE]
    return DASH if None in (a, b) else f"{a - b:+.0f}"


def batches(e):
    sizes = [b for run in e["runs"].values() for b in run["batch"]]
    return f"{min(sizes)}–{max(sizes)}"


TITLES = {"paired": "**Paired device time**", "adversarial": "**Adversarial inputs**",
          "host": "**Host time per call**", "first_call": "**First call of a new shape**", "memory": "**Peak memory**"}
COLUMNS = {
    "paired": [("stock fwd ms", ms("fwd_ms")), ("fwd openwam / stock", ratio("fwd_ms")),
               ("fwd A/A", ratio("fwd_ms", AGAIN)), ("stock fwd+bwd ms", ms("fwdbwd_ms")),
               ("fwd+bwd openwam / stock", ratio("fwdbwd_ms")), ("fwd+bwd A/A", ratio("fwdbwd_ms", AGAIN)),
               ("fwd bit-identical", lambda e: "yes" if e["fwd_bit_identical"] else "NO"), ("openwam plan", plan)],
    "adversarial": [("affected rows", lambda e: f"{SHARE_LABELS[e['share']]} ({e['affected_rows']})"),
                    ("stock fwd+bwd ms", ms("fwdbwd_ms")), ("openwam / stock", ratio("fwdbwd_ms")),
                    ("A/A", ratio("fwdbwd_ms", AGAIN)), ("non-finite grads stock / openwam", nonfinite_cell),
                    ("openwam plan", plan)],
    "host": [("stock fwd µs", ms("fwd_us", "{:.1f}")), ("openwam − stock", delta("fwd_us")),
             ("A/A", delta("fwd_us", AGAIN)), ("stock bwd µs", ms("bwd_us", "{:.1f}")),
             ("openwam − stock", delta("bwd_us")), ("A/A", delta("bwd_us", AGAIN)), ("openwam plan", plan)],
    "first_call": [("stock first ms", ms("first_ms", "{:.1f}")),
                   ("openwam first ms", ms("first_ms", "{:.1f}", OPENWAM)), ("openwam / stock", ratio("first_ms")),
                   ("A/A", ratio("first_ms", AGAIN)),
                   ("first / second, openwam / stock", ratio("first_over_second")),
                   ("A/A", ratio("first_over_second", AGAIN)),
                   ("stock second ms", ms("second_ms", "{:.2f}")), ("batch sizes", batches)],
    "memory": [("mask MiB", lambda e: num(e["mask_mib"], "{:.0f}")),
               ("stock peak MiB", lambda e: num(e["peak_mib"][BASE], "{:.0f}")),
               ("openwam peak MiB", lambda e: num(e["peak_mib"][OPENWAM], "{:.0f}")),
               ("openwam − stock MiB", memory_cells),
               ("finite stock / openwam", lambda e: " / ".join("yes" if e["finite"][n] else "NO"
                                                               for n in (BASE, OPENWAM))),
               ("openwam plan", plan)],
}


def intro(section, s):
    """What a section's table holds, from the run's settings."""
    return {
        "paired": f"ordinary random inputs; {s['rounds']} rounds of {s['repeats']} calls per contender, the order "
                  "rotating and reversing; each call enqueued behind a spin kernel, so an event pair holds only its kernels; a "
                  "cell is the median over rounds of the per-round ratio, [min–max]",
        "adversarial": "`openwam_sdpa.adversarial`: the affected query rows of every (b,h) have every logit near -110, "
                       "so their logsumexp is far below -88.7, the defect's trigger; paired fwd+bwd device time, "
                       f"{s['rounds']} rounds; non-finite grads: elements of dQ, dK and dV after one backward",
        "host": f"while a spin kernel holds the GPU, so no call waits for it; µs, median of {s['repeats']} calls per "
                f"round, {s['rounds']} paired rounds; backward: the autograd node called directly, as the engine "
                "calls it; differences from stock per round, median [min–max]",
        "first_call": "wall time of the first fwd+bwd, synchronised, of a batch size the process has not run, each "
                      f"contender its own in each of {s['first_rounds']} rounds, after a warm-up on the listed "
                      "shape; second: the next call on that shape",
        "memory": "one fwd+bwd, MiB requested (timing.peak_mib) above the inputs, the mask and the output gradient",
    }[section]


def summaries(section, entries):
    if section == "paired":
        return [summary_line("fwd+bwd openwam / stock", summary(entries, "fwdbwd_ms")),
                summary_line("fwd openwam / stock", summary(entries, "fwd_ms")),
                summary_line("fwd+bwd A/A control", summary(entries, "fwdbwd_ms", AGAIN))]
    if section == "adversarial":
        bad = sum(sum(e["nonfinite"][OPENWAM].values()) > 0 for e in entries if "nonfinite" in e)
        return [summary_line(f"{SHARE_LABELS[share]}: openwam / stock",
                             summary([e for e in entries if e.get("share") == share], "fwdbwd_ms"))
                for share in dict.fromkeys(e["share"] for e in entries if "share" in e)] + [
                f"- openwam_sdpa gave non-finite gradients in {bad} of {len(entries)} cells"]
    if section == "host":
        worst = [max((e["deltas"][OPENWAM][k]["median"] for e in entries if "deltas" in e), default=None)
                 for k in ("fwd_us", "bwd_us")]
        return [f"- openwam − stock, worst: forward {num(worst[0], '{:+.1f}')} µs, backward "
                f"{num(worst[1], '{:+.1f}')} µs"]
    if section == "first_call":
        return [summary_line("first call openwam / stock", summary(entries, "first_ms")),
                summary_line("first call over second, openwam / stock",
                              summary(entries, "first_over_second"))]
    return []


def covered_line(entries):
    """How often the spin outlasted the enqueueing of every timed call (None: no CUDA, no line)."""
    flags = [x for e in entries for run in e.get("runs", {}).values() for x in run.get("covered", []) if x is not None]
    return [f"- the spin kernel held the GPU until every call was enqueued in {sum(flags)}/{len(flags)} timings "
            "(otherwise a figure may hold host time)"] if flags else []


def markdown(result):
    s = result["settings"]
    parts = [f"### SDPA benchmark: {report.stack_title(result['stack'])}", "",
             "bf16, training; [B,S,H,D] storage seen as [B,H,S,D]. Contenders: stock F.sdpa (PyTorch's backend "
             "choice), openwam_sdpa at default settings, and stock again (A/A: its distance from 1 is the noise "
             "floor). Lower is better.", ""]
    for section in SECTIONS:
        if result.get(section):
            parts += [f"{TITLES[section]} ({intro(section, s)}):", "", table(result[section], COLUMNS[section]), "",
                      *summaries(section, result[section]), *covered_line(result[section]), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------- selftest


def check_selftest(result, md, out):
    """The outputs of a --selftest run (the CPU: every clock the host clock, no figure means
    anything): every section's table complete, every ratio and difference recomputable from
    the raw times, every summary from the ratios, the JSON rendering the same tables."""
    back = json.loads((out / "sdpa.json").read_text())
    assert markdown(back) == md, "--render of sdpa.json must give the same tables"
    for section in result["settings"]["sections"]:
        entries = result[section]
        assert entries and len(report.table_rows(md, TITLES[section])) == len(entries), section
        for e in entries:
            assert "error" not in e, (section, e["label"], e["error"])
            for name, by_key in e.get("ratios", {}).items():
                for key, r in by_key.items():
                    report.check_round_ratio(e["runs"], r, name, BASE, key)
            for name, by_key in e.get("deltas", {}).items():
                for key, d in by_key.items():
                    per_round = [a - b for a, b in zip(e["runs"][name][key], e["runs"][BASE][key])]
                    assert abs(d["median"] - timing.percentile(per_round, 50)) < 1e-9, (section, name, key)
    for section, key in (("paired", "fwdbwd_ms"), ("paired", "fwd_ms"), ("first_call", "first_ms")):
        if section in result["settings"]["sections"]:
            medians = [e["ratios"][OPENWAM][key]["median"] for e in result[section]]
            s = summary(result[section], key)
            assert s["cases"] == len(medians) and s["worst"] == max(medians)
            assert abs(s["geomean"] - timing.geomean(medians)) < 1e-12
            assert summary_line("", s).split(": ", 1)[1] in md, (section, key)
    if "paired" in result:
        assert all(e["fwd_bit_identical"] for e in result["paired"])  # the CPU: both run PyTorch's kernel
    if "adversarial" in result:
        for e in result["adversarial"]:
            c = e["case"]
            expected = {"none": 0, "one_per_head": c["b"] * c["h"], "all": c["b"] * c["h"] * c["sq"]}
            assert e["affected_rows"] == expected.get(e["share"], e["affected_rows"]), e["share"]
            # The CPU has no cuDNN defect: every gradient is finite.
            assert all(sum(n.values()) == 0 for n in e["nonfinite"].values()), e["nonfinite"]
        check_share_inputs()
    if "first_call" in result:  # every first call was on a batch size no call had before
        batches = [b for e in result["first_call"] for r in e["runs"].values() for b in r["batch"]]
        assert len(batches) == len(set(batches)) and all(
            b != e["case"]["b"] for e in result["first_call"] for r in e["runs"].values() for b in r["batch"])
    if "memory" in result:
        assert all(all(e["finite"].values()) for e in result["memory"])
    print(f"selftest OK: {', '.join(f'{s} {len(result[s])}' for s in result['settings']['sections'])}; wrote {out}")


def check_share_inputs():
    """ShareInputs composes a share from two builds: the tensors adversarial_inputs gives it."""
    import openwam_sdpa.adversarial as adv

    case, seed = TINY_ADVERSARIAL[0], 7
    (q, k, v), grad, count = ShareInputs(adv, case, "cpu", seed).select(0.1)
    sel = adv.affected_rows(0.1, case.b, case.h, case.sq, generator=torch.Generator().manual_seed(seed + 1))
    ref = adv.adversarial_inputs(case.b, case.h, case.sq, case.skv, case.d, rows=sel, layout="bshd",
                                 dtype=DTYPE, seed=seed)
    for got, want in ((q, ref.query), (k, ref.key), (v, ref.value), (grad, ref.grad_out)):
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert count == int(sel.sum())


# ---------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "sdpa",
                   help="output folder (default benchmarks/out/sdpa)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds: about 2 minutes on an H200")
    p.add_argument("--shapes", help="comma-separated substrings of case names (e.g. openwam,4096)")
    p.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8, --quick 4)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per contender and round (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    p.add_argument("--round-ms", type=float, default=150.0,
                   help="adversarial: about this much time per contender and round (fewer repeats where slow)")
    p.add_argument("--first-rounds", type=int, default=5, help="first_call: rounds, a new shape each (default 5)")
    p.add_argument("--render", type=Path, metavar="SDPA_JSON",
                   help="only write sdpa.md from an sdpa.json (a run cut short leaves a partial one)")
    p.add_argument("--selftest", action="store_true", help="tiny shapes on the CPU, then check the outputs")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes else None
    if args.quick:
        args.rounds, args.repeats, args.first_rounds = min(args.rounds, 4), min(args.repeats, 20), 3
    if args.selftest:
        args.rounds, args.repeats, args.warmup, args.first_rounds = 2, 2, 1, 2
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {','.join(SECTIONS)}")
    if min(args.rounds, args.repeats, args.first_rounds) < 1 or args.warmup < 0:
        p.error("--rounds, --repeats and --first-rounds must be >= 1, --warmup >= 0")
    if not args.render:
        empty = [s for s in args.sections if not cases_for(s, args)]
        if empty:
            p.error(f"--shapes leaves nothing to run in {empty}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:  # the tables of an earlier (maybe partial) run, on any machine
        result = json.loads(args.render.read_text())
        md = markdown(result)
        files = report.write_outputs(result, args.out, "sdpa", md)
        print(md)
        print(f"wrote {', '.join(files)} under {args.out}")
        return
    require_device(args.selftest)
    result = run(args)
    md = markdown(result)
    files = report.write_outputs(result, args.out, "sdpa", md)
    print(md)
    if args.selftest:
        check_selftest(result, md, args.out)
    print(f"wrote {', '.join(files)} under {args.out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
