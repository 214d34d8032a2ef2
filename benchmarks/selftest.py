"""What each benchmark's --selftest checks (CPU, tiny shapes; run in CI by
tests/test_bench_selftest.py). A selftest runs the benchmark's real code on the
CPU, so every clock falls back to the host clock and no figure means anything;
these checks cover the rest: every case measured, every table complete, every
ratio recomputable from its raw times, the outputs written."""

from __future__ import annotations

import copy
import json
import sys

import torch

from timing import percentile


def table_rows(md, title):
    """The body rows of the first markdown table after the line that starts with `title`."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows, seen_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen_table = True
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif seen_table:
            break
    assert rows, f"no table after {title!r}"
    return rows[2:]  # past the head and the |---| line


def check_files(out_dir, stem, pngs):
    back = json.loads((out_dir / f"{stem}.json").read_text())
    assert (out_dir / f"{stem}.md").stat().st_size > 0
    if "matplotlib" in sys.modules:
        for suffix in pngs:
            assert (out_dir / f"{stem}{suffix}.png").stat().st_size > 1000, f"{stem}{suffix}.png"
    return back


def check_round_ratio(runs, ratios, name, base, key):
    """A stored paired ratio is the median of the per-round ratios of the raw times."""
    per_round = [a / b for a, b in zip(runs[name][key], runs[base][key])]
    assert abs(ratios["median"] - percentile(per_round, 50)) < 1e-12
    assert ratios["min"] == min(per_round) and ratios["max"] == max(per_round)


# ------------------------------------------------------------------- bench_sdpa


def check_sdpa(result, md, out_dir, args):
    import sdpa_cases as cases
    import sdpa_report

    back = check_files(out_dir, "bench", pngs=("", "_shares") if "shares" in args.sections else ("",))
    assert sdpa_report.markdown(back) == md, "--render of bench.json must give the same tables"
    n = len(result["cases"])
    if "methods" in args.sections:
        assert n == len(back["cases"]) == len(result["settings"]["shapes"]) * len(result["settings"]["layouts"])
        for c in result["cases"]:
            for name, rec in c["methods"].items():
                assert "error" not in rec, (c["label"], name, rec["error"])
                assert ("skipped" in rec) == (name == "flash" and c["shape"]["mask"] is not None), (c["label"], name)
        for title in ("**Forward + backward**", "**Backward only:**", "**Forward only**",
                      "**Forward device time**", "**Forward + backward device time**",
                      "**Paired device time**", "**Host time per call**"):
            assert len(table_rows(md, title)) == n, title
        summary = result["summary"]["openwam-auto"]
        assert summary["measured"] == n and summary["errors"] == 0
        assert summary["geomean_fwdbwd_dev_ratio"] is not None and summary["max_fwd_dev_ratio"] is not None
        ps = result["paired_summary"]
        assert ps["openwam-default"]["measured"] == ps["cudnn-again"]["measured"] == n
        assert ps["fwd_bit_identical"].endswith(f"/{n}")
        assert ps["openwam-default"]["median_delta_bwd_host_us"] is not None
        pr = result["cases"][0]["paired"]
        check_round_ratio(pr["ms"], pr["ratios"]["openwam-default"]["fwd"], "openwam-default", cases.BASE, "fwd")
        # A failed method shows as err in its cell and is counted in the summary.
        broken = copy.deepcopy(result["cases"][:1])
        broken[0]["methods"]["efficient"] = {"error": "RuntimeError: made up by the selftest"}
        assert sdpa_report.summarize(broken, "efficient")["errors"] == 1
        assert "| err |" in sdpa_report.methods_table(broken, result["settings"]["methods"], "fwd", "fwd")
    if "shares" in args.sections:
        entries = result["shares"]
        assert len(entries) == len(result["settings"]["share_shapes"])
        assert len(table_rows(md, "**Affected share**")) == len(entries) * len(args.shares)
        assert md.count("default / cuDNN worst") == len(args.shares)  # a summary line per share
        for e in entries:
            s = e["shape"]
            expected = {"none": 0, "one_per_head": s["b"] * s["h"], "all": s["b"] * s["h"] * s["sq"]}
            for share, c in e["cells"].items():
                assert "ms" in c, (e["label"], share, c)
                assert c["affected_rows"] == expected.get(share, c["affected_rows"]), (e["label"], share)
                for name, check in c["checks"].items():
                    # The CPU has no cuDNN defect: every method's gradients are finite.
                    assert sum(check["nonfinite"].values()) == 0, (e["label"], share, name)
                check_round_ratio(c["ms"], c["ratios"]["default_vs_always"], "openwam-default",
                                   "openwam-always", "fwdbwd")
        check_share_inputs()
    if "memory" in args.sections:
        assert len(table_rows(md, "**Peak memory with large masks**")) == len(result["memory"]) > 0
        for e in result["memory"]:
            assert "error" not in e, e
            for name, rec in e["methods"].items():
                assert "error" not in rec and rec["finite"], (e["label"], name, rec)
    print(f"selftest OK: {n} methods cases, {len(result['shares'])} share shapes, "
          f"{len(result['memory'])} memory cases; wrote {out_dir}")


def check_share_inputs():
    """ShareInputs composes a share from two builds: the same tensors adversarial_inputs gives."""
    import openwam_sdpa.adversarial as adv

    from sdpa_cases import SELFTEST_SHARE_SHAPES, ShareInputs

    shape, seed = SELFTEST_SHARE_SHAPES[0], 7
    inputs = ShareInputs(adv, shape, "cpu", seed)
    (q, k, v), grad, _, count = inputs.select(0.1)
    sel = adv.affected_rows(0.1, shape.b, shape.h, shape.sq, generator=torch.Generator().manual_seed(seed + 1))
    ref = adv.adversarial_inputs(shape.b, shape.h, shape.sq, shape.skv, shape.d, rows=sel, layout="bshd",
                                 dtype=q.dtype, seed=seed)
    for got, want in ((q, ref.query), (k, ref.key), (v, ref.value), (grad, ref.grad_out)):
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert count == int(sel.sum())


# ------------------------------------------------------------------ bench_block


def check_block(result, md, out_dir):
    from bench_block import BASE

    back = check_files(out_dir, "block", pngs=("",))
    assert back["runs"].keys() == {BASE, "openwam", f"{BASE}-again"}
    for name, run in result["runs"].items():
        assert len(run["wall_ms"]) == result["settings"]["rounds"], name
        assert all(x > 0 for x in run["wall_ms"] + run["host_ms"]), name
    check_round_ratio(result["runs"], result["ratios"]["openwam"]["wall_ms"], "openwam", BASE, "wall_ms")
    assert len(table_rows(md, "### Block benchmark")) == 3  # GPU, host, wall
    # Three call patterns: the joint self-attention and the two text cross-attentions.
    assert len(result["decisions"]) == 3 and all("error" not in d for d in result["decisions"])
    assert result["profiles"].keys() == {BASE, "openwam"}
    for name, p in result["profiles"].items():
        assert p["ops"] and p["total_self_cpu_us"] > 0, name
    assert len(table_rows(md, "**Host time per op**")) == len(
        {op for p in result["profiles"].values() for op in p["ops"]}) + 1  # + the total
    print(f"selftest OK: block rounds, decisions and profiles; wrote {out_dir}")


# ------------------------------------------------------------------- bench_host


def check_host(result, md, out_dir):
    from bench_host import BASE

    back = check_files(out_dir, "host", pngs=())
    assert len(back["cases"]) == len(result["cases"]) >= 1
    rounds = result["settings"]["rounds"]
    for c in result["cases"]:
        for direction in ("forward", "backward"):
            runs, deltas = c[direction]["runs"], c[direction]["deltas"]
            assert BASE in runs and f"{BASE}-again" in runs and "openwam" in runs, direction
            for name, run in runs.items():
                assert len(run["us"]) == rounds and all(x > 0 for x in run["us"]), (direction, name)
            for name, d in deltas.items():  # a stored difference is recomputable from the raw times
                per_round = [a - b for a, b in zip(runs[name]["us"], runs[BASE]["us"])]
                assert abs(d["median"] - percentile(per_round, 50)) < 1e-9, (direction, name)
        assert c["op_profiles"].keys() == {BASE, "openwam"}
        calls, self_us = c["op_profiles"]["openwam"]["openwam::sdpa"]  # the profile saw the op
        assert calls == 1 and self_us > 0
    assert len(table_rows(md, "### Host time per call")) == len(result["cases"])
    assert len(table_rows(md, "**Host time per op**")) >= 1
    print(f"selftest OK: host layers, rounds and op profiles; wrote {out_dir}")


# ------------------------------------------------------------------ bench_model


def check_model(result, md, out_dir, args):
    from bench_model import BASE, grid, markdown

    back = check_files(out_dir, "model", pngs=("",))
    assert markdown(back) == md, "--render of model.json must give the same table"
    configs = result["configs"]
    assert [(e["size"], e["mode"], e["seq"], e["padding"]) for e in configs] == grid(args)
    assert {e["mode"] for e in configs} == {"eager", "compile"}
    assert len(table_rows(md, "### Model benchmark")) == len(configs)
    for e in configs:
        name = f"{e['size']} {e['mode']} {e['seq']} {e['padding']}"
        assert "error" not in e, (name, e["error"])
        first = e["first_step"]
        # The CPU has no cuDNN defect: every gradient is finite, and all three
        # implementations start from the same weights on the same batch.
        assert all(f["nonfinite_grads"] == 0 for f in first.values()), (name, first)
        assert all(e["loss_finite_at_end"].values()), name
        for other in ("openwam_sdpa", "sdpa-no-cudnn"):
            assert abs(first[other]["loss"] - first[BASE]["loss"]) <= 1e-2 * abs(first[BASE]["loss"]), (name, first)
        for who, run in e["runs"].items():
            # Each round's wall figure is the median of its steps, each timed on its own.
            assert len(run["wall_ms"]) == len(run["wall_steps_ms"]) == args.rounds, (name, who)
            for figure, steps in zip(run["wall_ms"], run["wall_steps_ms"]):
                assert len(steps) == args.wall_steps and figure == percentile(steps, 50), (name, who)
            assert len(run.get("gpu_ms", [])) == len(run.get("host_ms", [])) == args.gpu_rounds, (name, who)
        for other in ("openwam_sdpa", f"{BASE}-again"):
            check_round_ratio(e["runs"], e["ratios"][other]["wall_ms"], other, BASE, "wall_ms")
    assert f"the median of those {args.wall_steps} steps" in md, "model.md must say how wall time is measured"
    print(f"selftest OK: {len(configs)} model configurations; wrote {out_dir}")
