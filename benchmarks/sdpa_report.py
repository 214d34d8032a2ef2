"""The op benchmark's results: ratios to stock cuDNN, summaries, markdown tables and plots."""

from __future__ import annotations

from report import DASH, log_ratio_axis, md_table, num, pyplot, ratio, save_figure, spread, stack_title
from sdpa_cases import BASE, PAIRED_NAMES, SHARE_LABELS
from timing import geomean, percentile

MiB = 2.0**20
# Allocations of this size are rounded to 2 MiB blocks: a smaller peak difference is no difference.
MEMORY_SLACK_MIB = 2.0

# ------------------------------------------------------------ methods section


def figure(rec, key):
    """One figure of a method record, None if it failed or was skipped:
    "fwd" / "bwd" / "fwdbwd": median ms per call (per-call events; "_dev": device time),
    "host": median host µs per forward call, "peak": MiB above the inputs during one
    fwd+bwd, "saved": bytes kept for backward beyond q, k, v."""
    if not rec or "error" in rec or "skipped" in rec:
        return None
    if key == "host":
        return ((rec.get("fwd_dev") or {}).get("host_us") or [{}])[0].get("median_us")
    if key == "peak":
        return rec.get("peak_mib")
    if key == "saved":
        return (rec.get("saved") or {}).get("beyond_inputs_bytes")
    return (rec.get(key) or {}).get("median_ms")


RATIO_KEYS = ("fwd", "fwd_dev", "host", "bwd", "bwd_dev", "fwdbwd", "fwdbwd_dev", "peak", "saved")


def add_ratios(case):
    """rec["ratios"][key] = figure(rec, key) / figure(stock cuDNN's record, key), per method."""
    base = case["methods"].get(BASE)
    for rec in case["methods"].values():
        if "error" not in rec and "skipped" not in rec:
            rec["ratios"] = {k: ratio(figure(rec, k), figure(base, k)) for k in RATIO_KEYS}


def case_name(c):
    return f'{c["label"]} {c["mask"]} {c["layout"]}'


def summarize(cases, name):
    """Geomean and max of one method's ratios over all cases, and its forward bit-identity count."""
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


def paired_median(case, name, key, table="ratios"):
    """The median over rounds of a paired contender's ratio ("ratios") or host-time
    difference ("host_deltas_us") on `key`, or None."""
    r = ((case.get("paired") or {}).get(table) or {}).get(name) or {}
    return (r.get(key) or {}).get("median")


def summarize_paired(cases):
    """Geomean and max over the cases of each paired contender's median ratios to stock cuDNN,
    and the median and max of its host-time differences per call."""
    out = {}
    for name in PAIRED_NAMES:
        entry = {"measured": sum(paired_median(c, name, "fwd") is not None for c in cases)}
        for key in ("fwd", "fwdbwd", "fwd_host_us", "bwd_host_us"):
            vals = [(v, case_name(c)) for c in cases if (v := paired_median(c, name, key)) is not None]
            entry[f"geomean_{key}"] = geomean([v for v, _ in vals])
            entry[f"max_{key}"], entry[f"max_{key}_case"] = max(vals) if vals else (None, None)
        for key in ("fwd_host_us", "bwd_host_us"):
            vals = [(v, case_name(c)) for c in cases
                    if (v := paired_median(c, name, key, "host_deltas_us")) is not None]
            entry[f"median_delta_{key}"] = percentile([v for v, _ in vals], 50) if vals else None
            entry[f"max_delta_{key}"], entry[f"max_delta_{key}_case"] = max(vals) if vals else (None, None)
        out[name] = entry
    eq = [(c.get("paired") or {}).get("fwd_equal_cudnn", {}).get(PAIRED_NAMES[0]) for c in cases]
    out["fwd_bit_identical"] = f"{sum(e is True for e in eq)}/{sum(e is not None for e in eq)}"
    flags = [[x for run in c["paired"]["ms"].values() for x in run["covered"] if x is not None]
             for c in cases if "ms" in (c.get("paired") or {})]
    flags = [all(f) for f in flags if f]
    out["spin_covered"] = f"{sum(flags)}/{len(flags)}" if flags else "n/a (no CUDA)"
    return out


def summary_line(name, s):
    f = lambda x: num(x, "{:.3f}") if x is not None else "n/a"  # noqa: E731
    return (f"{name}: geomean fwd+bwd ratio {f(s['geomean_fwdbwd_ratio'])} over {s['measured']}/{s['cases']} "
            f"cases; max fwd+bwd {f(s['max_fwdbwd_ratio'])} ({s['max_fwdbwd_case']}); device time: "
            f"geomean fwd+bwd {f(s['geomean_fwdbwd_dev_ratio'])}, max fwd+bwd "
            f"{f(s['max_fwdbwd_dev_ratio'])}, max bwd {f(s['max_bwd_dev_ratio'])}; "
            f"max fwd {f(s['max_fwd_ratio'])} (device time {f(s['max_fwd_dev_ratio'])}, "
            f"host time per call {f(s['max_host_ratio'])}); max bwd {f(s['max_bwd_ratio'])}; "
            f"max peak-mem {f(s['max_peak_ratio'])}; forward bit-identical to stock cuDNN "
            f"{s['fwd_bit_identical']}; errors {s['errors']}")


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


def host_summary_line(ps):
    f = lambda x: "n/a" if x is None else f"{x:+.1f}"  # noqa: E731
    d, aa = ps[PAIRED_NAMES[0]], ps[PAIRED_NAMES[1]]
    return (f"host time per call, openwam_sdpa at default settings minus stock cuDNN (µs, median over rounds "
            f"per case; target at most +5): forward median {f(d['median_delta_fwd_host_us'])}, max "
            f"{f(d['max_delta_fwd_host_us'])} ({d['max_delta_fwd_host_us_case']}); backward median "
            f"{f(d['median_delta_bwd_host_us'])}, max {f(d['max_delta_bwd_host_us'])} "
            f"({d['max_delta_bwd_host_us_case']}). A/A control (stock again minus stock): forward median "
            f"{f(aa['median_delta_fwd_host_us'])}, max {f(aa['max_delta_fwd_host_us'])}; backward median "
            f"{f(aa['median_delta_bwd_host_us'])}, max {f(aa['max_delta_bwd_host_us'])}. Cases where the spin "
            f"held the GPU through every enqueueing: {ps['spin_covered']}")


def cell(rec, key):
    """A method's stored ratio on `key` as a table cell: — skipped or missing, err failed."""
    if not rec:
        return ""
    if "skipped" in rec:
        return DASH
    if "error" in rec:
        return "err"
    return num((rec.get("ratios") or {}).get(key), "{:.2f}")


def short(name):
    return name.replace("openwam-", "")


def plan_of(rec):
    return (rec.get("decision") or {}).get("plan", DASH)


def methods_table(cases, methods, key, title, extras=False, host=False):
    """One row per shape x layout: stock cuDNN's ms, then each method's ratio to it."""
    others = [m for m in methods if m != BASE]
    head = ["shape", "mask", "layout", f"cuDNN {title} ms"] + [short(m) for m in others]
    if extras:
        head += ["auto fwd (device)", "auto peak", "saved MiB cuDNN / auto", "auto plan"]
    if host:
        head += ["host µs/call cuDNN / auto", "max GPU gap µs"]
    rows = []
    for c in cases:
        ms = c["methods"]
        base = figure(ms.get(BASE), key)
        row = [c["label"], c["mask"], c["layout"], "err" if base is None else f"{base:.3f}"]
        row += [cell(ms.get(m), key) for m in others]
        if extras:
            auto = ms.get("openwam-auto", {})
            mib = [figure(ms.get(m), "saved") for m in (BASE, "openwam-auto")]
            row += [cell(auto, "fwd_dev"), cell(auto, "peak"),
                    " / ".join(DASH if x is None else f"{x / MiB:.1f}" for x in mib), str(plan_of(auto))]
        if host:
            us = [figure(ms.get(m), "host") for m in (BASE, "openwam-auto")]
            gaps = [r["fwd_dev"]["gap_us"] for r in ms.values() if (r.get("fwd_dev") or {}).get("gap_us") is not None]
            row += [" / ".join(num(x, "{:.0f}") for x in us), f"{max(gaps):.1f}" if gaps else DASH]
        rows.append(row)
    return md_table(head, rows)


def paired_table(cases):
    """The paired timing: per-round ratios' median [min–max] per contender."""
    head = ["shape", "mask", "layout", "cuDNN fwd device ms", "default fwd", "A/A fwd",
            "cuDNN fwd+bwd device ms", "default fwd+bwd", "A/A fwd+bwd", "fwd host µs/call cuDNN / default",
            "default plan", "fwd bit-identical"]
    rows = []
    for c in cases:
        pr = c.get("paired")
        if not pr:
            continue
        row = [c["label"], c["mask"], c["layout"]]
        if "error" in pr:
            rows.append(row + ["err"] * (len(head) - 3))
            continue
        for key in ("fwd", "fwdbwd"):
            row.append(f'{percentile(pr["ms"][BASE][key], 50):.3f}')
            row += [spread(pr["ratios"][name][key]) for name in PAIRED_NAMES]
        host = [percentile(pr["ms"][n]["fwd_host_us"], 50) for n in (BASE, PAIRED_NAMES[0])]
        ex = pr.get("decision") or {}
        row += [" / ".join(f"{x:.0f}" for x in host), f'{ex.get("plan", DASH)} ({ex.get("backend", DASH)})',
                "yes" if pr["fwd_equal_cudnn"].get(PAIRED_NAMES[0]) else "NO"]
        rows.append(row)
    return md_table(head, rows)


def host_table(cases):
    """Host time per call: stock's median [p10–p90], openwam's, and the per-round
    differences from stock of openwam and of stock again (the control)."""
    head = ["shape", "mask", "layout"]
    for phase in ("fwd", "bwd"):
        head += [f"{phase} host µs cuDNN [p10–p90]", f"{phase} default", f"{phase} default − cuDNN",
                 f"{phase} A/A − cuDNN"]
    rows = []
    for c in cases:
        pr = c.get("paired")
        if not pr or "error" in pr:
            continue
        row = [c["label"], c["mask"], c["layout"]]
        for phase in ("fwd", "bwd"):
            for name in (BASE, PAIRED_NAMES[0]):
                runs = pr["ms"][name]
                med, lo, hi = (percentile(runs[f"{phase}_host{s}_us"], 50) for s in ("", "_p10", "_p90"))
                row.append(f"{med:.1f} [{lo:.0f}–{hi:.0f}]")
            row += [spread(pr["host_deltas_us"][n][f"{phase}_host_us"], "{:+.1f}", "{:+.0f}") for n in PAIRED_NAMES]
        rows.append(row)
    return md_table(head, rows)


# -------------------------------------------------------------- shares section


def share_label(key):
    """The label of a share stored under str(share) ("none", "one_per_head", "0.1", "all")."""
    return next((v for k, v in SHARE_LABELS.items() if str(k) == key), key)


def nonfinite_total(check):
    if "error" in check:
        return "err"
    return str(sum(check.get("nonfinite", {}).values()))


def shares_table(entries):
    """One row per shape x share: paired fwd+bwd ratios and the non-finite gradients of each method."""
    head = ["shape", "mask", "affected rows", "cuDNN fwd+bwd device ms", "default / cuDNN", "always / cuDNN",
            "default / always", "A/A", "non-finite grads cuDNN / default / always", "repaired rows (default)",
            "default plan"]
    rows = []
    for e in entries:
        for share, c in e["cells"].items():
            row = [e["label"], e["mask"], f"{share_label(share)} ({c.get('affected_rows', DASH)})"]
            if "ms" not in c:
                checks = c.get("checks", {})
                rows.append(row + [c.get("error", "err")[:60]] + [DASH] * 4
                            + [" / ".join(nonfinite_total(checks.get(n, {"error": 1}))
                                          for n in (BASE, "openwam-default", "openwam-always")), DASH, DASH])
                continue
            r = c["ratios"]
            checks = c["checks"]
            default = checks.get("openwam-default", {})
            row += [f'{percentile(c["ms"][BASE]["fwdbwd"], 50):.3f}', spread(r.get("openwam-default")),
                    spread(r.get("openwam-always")), spread(r.get("default_vs_always")), spread(r.get("cudnn-again")),
                    " / ".join(nonfinite_total(checks[n]) for n in (BASE, "openwam-default", "openwam-always")),
                    str(default.get("repaired_rows", DASH)),
                    f'{plan_of(default)} ({(default.get("decision") or {}).get("backend", DASH)})']
            rows.append(row)
    return md_table(head, rows)


# Issue 12's bounds on openwam_sdpa at default settings / stock cuDNN, per share; and on
# default / OPENWAM_SDPA_PAD=always at every share.
SHARE_TARGETS = {"none": 1.03, "one_per_head": 1.05, "0.1": 1.25, "all": 1.6}
ALWAYS_TARGET = 1.10


def shares_summary(entries):
    """Per share: the worst median ratio over the shapes of default / cuDNN, default / always
    and the A/A control, and the bound."""
    lines = []
    for share in dict.fromkeys(k for e in entries for k in e["cells"]):
        cells = [(e, e["cells"][share]) for e in entries if "ratios" in e["cells"].get(share, {})]

        def worst(key):
            vals = [((c["ratios"].get(key) or {}).get("median"), f'{e["label"]} {e["mask"]}') for e, c in cells]
            vals = [v for v in vals if v[0] is not None]
            return f"{max(vals)[0]:.3f} ({max(vals)[1]})" if vals else "n/a"

        bound = SHARE_TARGETS.get(share)
        lines.append(f"{share_label(share)}: default / cuDNN worst {worst('openwam-default')}"
                     + (f" (target at most {bound:g})" if bound else "")
                     + f"; default / always worst {worst('default_vs_always')} (target at most {ALWAYS_TARGET:g}); "
                     f"A/A worst {worst('cudnn-again')}; over {len(cells)} shapes")
    return lines


def plot_shares(result, path):
    """fwd+bwd time vs share of affected rows: default and always / stock cuDNN, and default / always."""
    plt = pyplot()
    entries = result.get("shares") or []
    if plt is None or not entries:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for i, e in enumerate(entries):
        shares = [s for s, c in e["cells"].items() if "ratios" in c]
        xs = range(len(shares))
        color = f"C{i % 10}"

        def ys(key):
            return [(e["cells"][s]["ratios"].get(key) or {}).get("median", float("nan")) for s in shares]

        left.plot(xs, ys("openwam-default"), "o-", color=color, label=f'{e["label"]} {e["mask"]}')
        left.plot(xs, ys("openwam-always"), "x--", color=color)
        right.plot(xs, ys("default_vs_always"), "o-", color=color, label=f'{e["label"]} {e["mask"]}')
        for ax in (left, right):
            ax.set_xticks(list(xs), [share_label(s) for s in shares])
    log_ratio_axis(left, "fwd+bwd device time / stock cuDNN (log)")
    log_ratio_axis(right, "default / OPENWAM_SDPA_PAD=always (log)")
    left.set_title("default (o, solid) and always (x, dashed) vs stock cuDNN", fontsize=9)
    right.set_title("default vs always", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("affected query rows")
    right.legend(fontsize=7)
    fig.suptitle(f"Repair cost by share of affected rows — {stack_title(result['stack'])}", fontsize=9)
    return save_figure(fig, path)


# -------------------------------------------------------------- memory section


# (openwam method, the stock method it is compared with) in the memory table.
MEMORY_PAIRS = (("openwam-default", "stock"), ("openwam-efficient", "stock-efficient"))


def memory_table(entries):
    head = ["shape", "mask", "mask MiB"]
    for ow_name, stock_name in MEMORY_PAIRS:
        which = "efficient only" if "efficient" in ow_name else "default backends"
        head += [f"{which}: stock peak MiB", "openwam peak MiB", "openwam − stock MiB", "at most stock",
                 "openwam plan"]
    rows = []
    for e in entries:
        row = [e["label"], e["mask"], num(e.get("mask_mib"), "{:.0f}")]
        if "error" in e:
            rows.append(row + [e["error"][:60]] + [DASH] * (len(head) - 4))
            continue
        for ow_name, stock_name in MEMORY_PAIRS:
            a, b = e["methods"].get(ow_name, {}), e["methods"].get(stock_name, {})
            pa, pb = a.get("peak_mib"), b.get("peak_mib")
            diff = None if pa is None or pb is None else pa - pb
            ex = a.get("decision") or {}
            row += ["err" if "error" in b else num(pb, "{:.0f}"), "err" if "error" in a else num(pa, "{:.0f}"),
                    num(diff, "{:+.0f}"), DASH if diff is None else ("yes" if diff <= MEMORY_SLACK_MIB else "NO"),
                    f'{ex.get("plan", DASH)} ({ex.get("backend", DASH)}/{ex.get("pytorch_choice", DASH)})']
        rows.append(row)
    return md_table(head, rows)


# --------------------------------------------------------------------- markdown


def methods_markdown(result):
    cases, methods, s = result["cases"], result["settings"]["methods"], result["settings"]
    parts = [
        f"bf16, training (inputs require grad). Median of {s['repeats']} CUDA-event timings after "
        f"{s['warmup']} warm-up calls. Ratios are to stock cuDNN (`sdpa_kernel(CUDNN_ATTENTION)`) on "
        "the same shape and layout; lower is better. Methods: efficient / flash = stock "
        "F.sdpa backends (flash: no mask only, — elsewhere); pad-fwd = pad K/V and mask before the "
        "forward, then stock cuDNN; auto / always / never = openwam_sdpa with OPENWAM_SDPA_PAD=that "
        "and OPENWAM_SDPA_CUDNN=1. bshd = [B,S,H,D] storage viewed as [B,H,S,D]; bhsd = contiguous. "
        "cudnn-again = stock cuDNN measured a second time, after the others: its distance from 1.00 "
        "is the noise floor of this run. Bool masks are key-padding masks of the stated shape. "
        "The auto setting's dQ repair kernel is included in its timings.",
        "",
        "**Forward + backward** (auto fwd (device) / auto peak: ratios of forward device time (the "
        "forward device table below) and of peak memory of one fwd+bwd; saved MiB: bytes kept for "
        "backward beyond q, k, v):",
        "",
        methods_table(cases, methods, "fwdbwd", "fwd+bwd", extras=True),
        "",
        "**Summary** (over all shape x layout rows):",
        "",
    ]
    parts += [f"- {summary_line(short(m), result['summary'][m])}" for m in methods if m != BASE]
    parts += ["", "**Backward only:**", "", methods_table(cases, methods, "bwd", "bwd"),
              "", "**Forward only** (grad mode):", "", methods_table(cases, methods, "fwd", "fwd"), "",
              "**Forward device time** (grad mode; all repeats enqueued behind a spin kernel, so "
              "each event pair holds only the call's kernels and no host launch gap; host µs/call: "
              "the host's median time per forward call while enqueueing; max GPU gap: the longest "
              "idle time between two calls on the GPU over all methods, about 0 when the figures "
              "are pure device time):", "",
              methods_table(cases, methods, "fwd_dev", "fwd device", host=True), "",
              "**Forward + backward device time** (the same method: each repeat's forward and "
              "backward enqueued behind the spin kernel):", "",
              methods_table(cases, methods, "fwdbwd_dev", "fwd+bwd device"), ""]
    flags = [rec[k]["covered"] for c in cases for rec in c["methods"].values()
             for k in ("fwd_dev", "bwd_dev", "fwdbwd_dev") if (rec.get(k) or {}).get("covered") is not None]
    if flags:
        parts += [f"The spin held the GPU until every repeat was enqueued in {sum(flags)}/{len(flags)} device "
                  "timings (otherwise a figure may hold host time).", ""]
    if result.get("paired_summary"):
        ps = result["paired_summary"]
        parts += [f"**Paired device time** (openwam_sdpa at default settings, no OPENWAM_SDPA_* variable "
                  f"set, against stock cuDNN and stock cuDNN again, the A/A control: "
                  f"{s.get('paired_rounds')} rounds, each timing every contender's forward and "
                  f"forward+backward as device time over {s.get('paired_repeats')} repeats, the order "
                  "rotating from round to round; each cell is the median over rounds of the per-round "
                  "ratio to stock cuDNN, [min–max] over rounds):", "",
                  paired_table(cases), "", f"- {paired_summary_line(ps)}", "",
                  "**Host time per call** (the same paired rounds: the host's time for each forward call "
                  "and each backward call while a spin kernel holds the GPU, so no call waits for it; "
                  "µs, median over rounds of each round's median [p10–p90]; the differences from stock "
                  "cuDNN are per round, median [min–max] over rounds; A/A = stock cuDNN again, the "
                  "control):", "", host_table(cases), "", f"- {host_summary_line(ps)}", ""]
    return parts


def shares_markdown(result):
    s = result["settings"]
    return [f"**Affected share** (adversarial inputs from `openwam_sdpa.adversarial`: query rows whose "
            "logits are all near -110, so their logsumexp is far below -88.7; share = which rows of every "
            "(batch, head): none, one per (b,h), each with probability 0.1, all. BSHD storage, bf16. "
            "Paired fwd+bwd device time of stock cuDNN, openwam_sdpa at default settings, "
            "OPENWAM_SDPA_PAD=always (with OPENWAM_SDPA_CUDNN=1) and stock cuDNN again (A/A), "
            f"{s.get('share_rounds')} rounds, up to {s.get('share_repeats')} repeats each (fewer where a "
            "call is slow); median [min–max] over rounds of the per-round ratio. Non-finite grads: elements "
            "of dQ, dK and dV that are not finite after one backward (stock's NaN at shares above none is "
            "the defect); repaired rows: openwam_sdpa.repaired_rows() after that backward):", "",
            shares_table(result["shares"]), ""] + [f"- {line}" for line in shares_summary(result["shares"])] + [""]


def memory_markdown(result):
    return [f"**Peak memory with large masks** (one forward+backward, MiB allocated above the inputs, "
            "the mask and the output gradient; bool = causal [B,H,S,S] materialised, additive = random "
            "[B,H,S,S] in bf16, bool [1,1,S,S] expanded = a stride-0 view over batch and heads. Default "
            "backends: F.sdpa with PyTorch's choice vs openwam_sdpa at default settings; efficient only: "
            "both under `sdpa_kernel(EFFICIENT_ATTENTION)`, as in PyTorch's "
            f"test_mem_eff_attention_long_sequence_mask. At most stock: within {MEMORY_SLACK_MIB:g} MiB, "
            "one allocator block):", "", memory_table(result["memory"]), ""]


def markdown(result):
    st = result["stack"]
    parts = [f"### SDPA benchmark: {st['gpu']}, torch {st['torch']}, cuDNN {st['cudnn']}, {st['date'][:10]}", ""]
    if result.get("cases"):
        parts += methods_markdown(result)
    if result.get("shares"):
        parts += shares_markdown(result)
    if result.get("memory"):
        parts += memory_markdown(result)
    return "\n".join(parts)


def plot_methods(result, path):
    """Grouped bars: fwd+bwd time ratio to stock cuDNN per shape x layout and method."""
    plt = pyplot()
    cases = result.get("cases") or []
    if plt is None or not cases:
        return False
    others = [m for m in result["settings"]["methods"] if m != BASE]
    width = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(cases)), 5.5))
    for i, m in enumerate(others):
        ys = [((c["methods"].get(m) or {}).get("ratios") or {}).get("fwdbwd") for c in cases]
        xs = [j + (i - (len(others) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, [float("nan") if y is None else y for y in ys], width, label=short(m))
    log_ratio_axis(ax, "fwd+bwd time / stock cuDNN (log)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c['shape']['sq']}x{c['shape']['skv']} {'mask' if c['shape']['mask'] else 'none'}"
                        f"\nB{c['shape']['b']} D{c['shape']['d']} {c['layout']}" for c in cases],
                       fontsize=7, rotation=45, ha="right")
    ax.set_title(f"SDPA fwd+bwd vs stock cuDNN — {stack_title(result['stack'])}", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    return save_figure(fig, path)
