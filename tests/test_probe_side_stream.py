"""scripts/probe_side_stream.py (BENCHMARKS.md's runs J1, J3, L5, L7),
scripts/probe_programmatic_launch.py (runs M1-M2, M6),
scripts/probe_row_stream.py (runs N1-N3) and scripts/probe_split_keys.py
(runs Q1-Q4): each probes the share table's own
cells, and without a GPU each says it needs one. The row-stream probe's
float64 reference and threshold are checked here too."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support import ROOT, load_script, script_path

PROBES = ("probe_side_stream.py", "probe_programmatic_launch.py", "probe_row_stream.py",
          "probe_split_keys.py")


@pytest.mark.parametrize("name", PROBES)
def test_cells_are_share_table_cells(name):
    """Each probed cell is a shape and head_dim of bench_sdpa's share table
    (benchmarks/sdpa_cases.py), with a mask exactly where the table has one."""
    probe = load_script(name)  # puts benchmarks/ on sys.path
    import sdpa_cases

    table = {(s.b, s.h, s.sq, s.skv, s.mask is not None) for s in sdpa_cases.SHARE_SHAPES}
    assert probe.CELLS
    for B, H, s_q, s_kv, mask, D in probe.CELLS:
        assert (B, H, s_q, s_kv, mask != "none") in table, (B, H, s_q, s_kv, mask)
        assert D in sdpa_cases.SHARE_HEAD_DIMS


@pytest.mark.parametrize("name", PROBES)
def test_needs_a_gpu(name):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, script_path(name)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "needs a CUDA device" in run.stderr


def test_row_stream_threshold_is_the_repairs():
    """The prototype lists the rows the landed repair recomputes."""
    header = (Path(ROOT) / "csrc" / "repair_dq.h").read_text()
    threshold = float(re.search(r"kRepairLseThreshold = (-?[0-9.]+)f;", header).group(1))
    assert load_script("probe_row_stream.py").THRESHOLD == threshold


@pytest.mark.parametrize("with_bias", [False, True])
def test_row_stream_reference_rows_are_autograd_dq(with_bias):
    """reference_rows (the probe's float64 dQ of single rows, GQA and a
    broadcast bias) against autograd through F.scaled_dot_product_attention."""
    probe = load_script("probe_row_stream.py")
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, s_q, s_kv, D = 2, 4, 2, 5, 7, 8
    q = torch.randn(B, H, s_q, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, s_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, s_kv, D, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, s_q, D, generator=g, dtype=torch.float64)
    bias = torch.randn(B, 1, s_q, s_kv, generator=g, dtype=torch.float64) if with_bias else None
    scale = D ** -0.5
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=bias,
        scale=scale)
    (dq,) = torch.autograd.grad(out, q, go)
    rows = [(0, 0, 0), (0, 3, 4), (1, 1, 2)]
    cell = SimpleNamespace(q=q.detach(), k=k, v=v, go=go, bias=bias, scale=scale)
    want = torch.stack([dq[b, h, i] for b, h, i in rows])
    torch.testing.assert_close(probe.reference_rows(cell, rows), want, rtol=1e-10, atol=1e-12)


def test_row_stream_affected_rows_and_their_error():
    """affected_rows lists the rows below the repair's threshold (not the -inf
    rows, which the repair zeroes), and worst_row_error is 0 on the float64
    reference and a row's max error over its max |reference| otherwise."""
    probe = load_script("probe_row_stream.py")
    g = torch.Generator().manual_seed(1)
    B, H, s_q, s_kv, D = 2, 3, 6, 5, 8
    lse = torch.zeros(B, H, s_q, 1)
    lse[0, 1, 2] = probe.THRESHOLD - 1.0
    lse[1, 2, 5] = probe.THRESHOLD - 50.0
    lse[1, 0, 0] = float("-inf")
    lse[0, 0, 3] = probe.THRESHOLD + 1.0
    cell = SimpleNamespace(
        q=torch.randn(B, H, s_q, D, generator=g), k=torch.randn(B, H, s_kv, D, generator=g),
        v=torch.randn(B, H, s_kv, D, generator=g), go=torch.randn(B, H, s_q, D, generator=g),
        bias=None, scale=D ** -0.5, lse=lse)
    low, picked, ref = probe.affected_rows(cell)
    assert picked == [[0, 1, 2], [1, 2, 5]]
    assert low.sum().item() == 2 and low.shape == (B, H, s_q)
    dq = torch.zeros(B, H, s_q, D, dtype=torch.float64)
    for (b, h, i), row in zip(picked, ref):
        dq[b, h, i] = row
    assert probe.worst_row_error(dq, picked, ref) == 0.0
    dq[1, 2, 5, 3] += 0.25 * ref[1].abs().max()
    assert probe.worst_row_error(dq, picked, ref) == pytest.approx(0.25)


def test_row_stream_affected_rows_spread_over_the_heads():
    """With more affected rows than it checks, affected_rows takes every
    k-th of them in (b, h, i) order, so the picked rows reach the last heads."""
    probe = load_script("probe_row_stream.py")
    B, H, s_q, s_kv, D = 2, 4, 10, 3, 8
    lse = torch.full((B, H, s_q, 1), probe.THRESHOLD - 5.0)  # every row affected: 80
    cell = SimpleNamespace(q=torch.randn(B, H, s_q, D), k=torch.randn(B, H, s_kv, D),
                           v=torch.randn(B, H, s_kv, D), go=torch.randn(B, H, s_q, D),
                           bias=None, scale=D ** -0.5, lse=lse)
    low, picked, ref = probe.affected_rows(cell, at_most=8)
    assert int(low.sum()) == 80 and len(picked) == 8 and ref.shape == (8, D)
    assert picked[0] == [0, 0, 0] and picked[1] == [0, 1, 0] and picked[-1] == [1, 3, 0]


def test_leaf_cell_steps_run_the_backward_first():
    """LeafCell.then(fn) and .repaired, the probes' timed steps: cuDNN's
    backward, then the step's work on that backward's dQ, which it returns;
    probe_parser gives every probe the same --rounds and --repeats."""
    leaf_cells = load_script("leaf_cells.py")
    z = torch.zeros(1)
    cell = leaf_cells.LeafCell(z, z, z, z, None, z, z, z, z, 0.5)
    calls = []
    dq = torch.ones(3)

    def backward(plan=leaf_cells.PLAN_NONE):
        calls.append("backward" if plan == leaf_cells.PLAN_NONE else f"backward plan {plan}")
        return dq, z, z

    cell.backward = backward
    cell.repair = lambda x: calls.append(("repair", x is dq))
    assert cell.repaired(None) is dq and calls == ["backward", ("repair", True)]
    assert cell.repaired is cell.repaired  # one step object, built once
    calls.clear()
    assert cell.then(lambda x: calls.append(("other", x is dq)))() is dq
    assert calls == ["backward", ("other", True)]
    parser = leaf_cells.probe_parser("What it probes.\n\nMore.", rounds=7, repeats=11)
    assert parser.description == "What it probes."
    args = parser.parse_args([])
    assert (args.rounds, args.repeats) == (7, 11)
    args = parser.parse_args(["--rounds", "2", "--repeats", "3"])
    assert (args.rounds, args.repeats) == (2, 3)


def test_split_keys_forms_reach_the_kernel_with_their_arguments():
    """probe_split_keys' timed variants are its FORMS, in order, and run_form
    hands each one's (engine, max_cluster, mode) to split_keys after the cell's
    tensors, scale and the repair's threshold; the forms whose accuracy is
    checked are those that repair (mode 1)."""
    probe = load_script("probe_split_keys.py")
    assert probe.VARIANTS == ("split", "split16", "pipe", "pipe_scan", "pipe_read", "scan",
                              "read", "reg", "reg_early", "reg_tileocc", "reg_occ", "reg_pdl")
    assert probe.REPAIRS == ("split", "split16", "pipe", "reg", "reg_early", "reg_tileocc",
                             "reg_occ", "reg_pdl")
    seen = []
    ext = SimpleNamespace(split_keys=lambda *args: seen.append(args))
    c = SimpleNamespace(go="go", q="q", k="k", v="v", out="out", lse="lse", bias=None,
                        scale=0.125)
    for name in ("split16", "pipe_read", "reg_tileocc"):
        probe.run_form(ext, c, "dq", name)
    head = ("dq", "go", "q", "k", "v", "out", "lse", None, 0.125, probe.THRESHOLD)
    assert seen == [head + (0, 16, 1), head + (1, 0, 2), head + (4, 0, 1)]


@pytest.mark.parametrize("argv, message", [
    (["--forms", "reg,regg"], "unknown forms ['regg']"),
    (["--light", "regg"], "unknown forms ['regg']"),
    (["--shares", "none,half"], "could not convert string to float: 'half'"),
    (["--tile-shares", "0.1,1.5"], "share 1.5: not in (0, 1)"),
    (["--cells", "999"], "--cells matches none of"),
])
def test_split_keys_refuses_bad_options_before_any_gpu_work(argv, message, capsys):
    """Forms, shares and cells are checked when the command line is read: a
    typo is an error (exit 2) before the build and the first section."""
    probe = load_script("probe_split_keys.py")
    with pytest.raises(SystemExit) as e:
        probe.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_split_keys_options_reach_the_cells(monkeypatch, capsys):
    """main hands --cells' cells, --shares and --tile-shares (fractions as numbers)
    and --layout to each cell, and times --forms beside the landed repair; the
    tiles section runs the landed repair after --light."""
    probe = load_script("probe_split_keys.py")
    made, timed, ran = [], [], []

    class Cell:
        def __init__(self, cell, share):
            self.cell, self.share = cell, share
            self.repaired = "landed"

        def then(self, fn):
            return fn

        def backward(self):
            return None

        def repair(self, dq):
            ran.append(("landed", self.share))

    def leaf_cell(cell, share, layout):
        made.append((probe.cell_name(cell), share, layout))
        return Cell(cell, share)

    def paired_added(cell, share, stock, steps, rounds, repeats):
        timed.append((probe.cell_name(cell), share, tuple(steps)))
        for name, step in steps.items():
            if callable(step):
                step("dq")
        return None, "line"

    monkeypatch.setattr(probe, "start", lambda script: None)
    monkeypatch.setattr(probe, "extension", lambda: "ext")
    monkeypatch.setattr(probe, "leaf_cell", leaf_cell)
    monkeypatch.setattr(probe, "paired_added", paired_added)
    monkeypatch.setattr(probe, "accuracy", lambda ext, c, names: f"accuracy {names}")
    monkeypatch.setattr(probe, "run_form", lambda ext, c, dq, name: ran.append((name, c.share)))
    probe.main(["--cells", "704x704:64", "--forms", "reg_occ,pipe_scan", "--shares",
                "none,one_per_head", "--tile-shares", "0.25,all", "--light", "reg_pdl",
                "--layout", "bhsd"])
    assert made == [("704x704:64", "none", "bhsd"), ("704x704:64", "one_per_head", "bhsd"),
                    ("704x704:64", 0.25, "bhsd"), ("704x704:64", "all", "bhsd")]
    assert timed == [("704x704:64", "none", ("landed", "reg_occ", "pipe_scan")),
                     ("704x704:64", "one_per_head", ("landed", "reg_occ", "pipe_scan")),
                     ("704x704:64", "0.25", ("landed", "reg_pdl+landed")),
                     ("704x704:64", "all", ("landed", "reg_pdl+landed"))]
    # The tiles section: the light form, then the landed repair, on the same dQ.
    assert ran[-4:] == [("reg_pdl", 0.25), ("landed", 0.25), ("reg_pdl", "all"), ("landed", "all")]
    # Accuracy only of the forms that repair (pipe_scan is the scan alone).
    assert "accuracy ['reg_occ']" in capsys.readouterr().out
