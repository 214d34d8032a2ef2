"""examples/ run on the CPU with tiny sizes, as a user runs them (as
__main__, with command-line flags): a finite loss every step, and a last
line that gives the verdict and names the attention that ran."""

from __future__ import annotations

import math
import pathlib
import re
import runpy
import sys

import pytest
import torch

import openwam_sdpa

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TINY = ["--device", "cpu", "--steps", "3", "--batch", "3", "--seq", "40", "--layers", "1"]
STEP = re.compile(r"^step (\d+): loss (\S+)  grad norm (\S+)$", re.M)
VERDICT = re.compile(r"^verdict: (finite|NOT finite): (.+); attention: (.+)$")
CPU_NOTE = "note: no NaN to show here: the NaN demonstration needs a CUDA GPU with cuDNN attention"
# The cuDNN path's work over the run (openwam_sdpa.frontend_stats()): none on the CPU.
NO_CUDNN_WORK = ("calls on shifted scores: 0, with cuDNN's padding mask: 0, "
                 "calls on the ATen fallback: 0")


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    """As `python examples/NAME.py` puts the script's folder on sys.path (the
    examples share examples/attention_verdict.py); runpy does not."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def run_example(name, args, monkeypatch, capsys):
    """(stdout, whether F.sdpa was left patched)."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        left_patched = openwam_sdpa.is_patched()
    finally:
        openwam_sdpa.unpatch()
    return capsys.readouterr().out, left_patched


def load(name):
    """The example's functions, without running it."""
    return runpy.run_path(str(EXAMPLES / name), run_name="example")


def assert_trains(out, steps=3):
    rows = STEP.findall(out)
    assert [int(s) for s, _, _ in rows] == list(range(steps)), out
    losses = [float(loss) for _, loss, _ in rows]
    assert all(math.isfinite(x) for x in losses), out
    assert all(math.isfinite(float(g)) for _, _, g in rows), out
    assert losses[-1] < losses[0], out  # AdamW on a fixed batch: the loss falls


def verdict_of(out, steps=3):
    """The attention named by the last line, which must say finite."""
    lines = out.rstrip().splitlines()
    m = VERDICT.match(lines[-1])
    assert m, lines[-1]
    assert m.group(1, 2) == ("finite", f"loss and gradients finite in all {steps} steps"), lines[-1]
    assert lines[-2].startswith(CPU_NOTE), lines[-2]  # the CPU run says what it cannot show
    return m.group(3)


def op_route(q, k, v, mask, enable_gqa=False):
    """What the verdict must say for openwam_sdpa, from the op's own explain()."""
    p = openwam_sdpa.explain(q, k, v, mask, enable_gqa=enable_gqa)
    assert p["engine"] == ""  # off the cuDNN path: the verdict names no engine
    return f"openwam_sdpa, route {p['route']} ({p['reason']}), plan {p['plan']}"


def test_hf_example(monkeypatch, capsys):
    pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    out, _ = run_example("train_hf.py", [*TINY, "--hidden", "64", "--heads", "2"], monkeypatch, capsys)
    assert out.startswith("openwam_sdpa on cpu:"), out
    assert_trains(out)
    # Qwen2 with 2 heads over 1 key/value head, head_dim 32, fp32 on the CPU.
    q = torch.zeros(3, 2, 40, 32, requires_grad=True)
    kv = torch.zeros(3, 1, 40, 32)
    expected = op_route(q, kv, kv, torch.ones(3, 1, 40, 40, dtype=torch.bool), enable_gqa=True)
    assert verdict_of(out) == f"{expected}; {NO_CUDNN_WORK}"


@pytest.mark.parametrize("attn,attention", [
    ("sdpa", "stock F.scaled_dot_product_attention ("),
    ("eager", "no scaled_dot_product_attention call seen"),
])
def test_hf_example_other_attention(attn, attention, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    out, _ = run_example("train_hf.py", [*TINY, "--hidden", "64", "--heads", "2", "--attn", attn],
                         monkeypatch, capsys)
    assert_trains(out)
    assert verdict_of(out).startswith(attention)


def test_hf_example_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(SystemExit, match=re.escape('pip install --no-build-isolation ".[hf]"')):
        load("train_hf.py")


@pytest.mark.parametrize("route", ["with", "global", "stock"])
def test_patch_example(route, monkeypatch, capsys):
    out, left_patched = run_example(
        "train_patch.py", [*TINY, "--dim", "64", "--heads", "2", "--route", route], monkeypatch, capsys)
    # The header says what routes the calls; stock runs no patch().
    header = out.splitlines()[0]
    assert header.endswith(" on cpu: batch 3 x 40 tokens, left-padded"), header
    assert ("patch()" in header) == (route != "stock"), header
    assert header.startswith({"with": "with openwam_sdpa.patch():",
                              "global": "openwam_sdpa.patch()",
                              "stock": "stock F.scaled_dot_product_attention"}[route]), header
    assert_trains(out)
    # patch() stays on; `with openwam_sdpa.patch():` restores on exit.
    assert left_patched == (route == "global")
    q = torch.zeros(3, 2, 40, 32, requires_grad=True)
    mask = torch.ones(3, 1, 40, 40, dtype=torch.bool)
    attention = verdict_of(out)
    if route == "stock":
        assert attention.startswith("stock F.scaled_dot_product_attention ("), attention
    else:
        assert attention == f"{op_route(q, q.detach(), q.detach(), mask)}; {NO_CUDNN_WORK}"


def test_a_non_finite_step_makes_the_verdict_say_so(capsys):
    """The verdict reads the steps: a model gone NaN is reported as such."""
    ex = load("train_patch.py")
    model = ex["TinyLM"](50, 16, 2, 1)
    with torch.no_grad():
        model.embed.weight[7] = float("nan")
    batch = ex["left_padded_batch"](2, 12, 50, "cpu")
    batch[0][1, 5] = 7  # one token reads the NaN row
    bad_steps, first_call = ex["train"](model, batch, 3, torch.device("cpu"))
    assert bad_steps == [0, 1, 2]
    line = ex["verdict"](bad_steps, 3, first_call, openwam_sdpa.frontend_stats())
    assert line.startswith("verdict: NOT finite: loss or gradients non-finite from step 0 (3 of 3 steps); "
                           "attention: stock F.scaled_dot_product_attention ("), line
    capsys.readouterr()


def test_the_verdict_on_the_cuda_path_names_the_engine_and_the_fix():
    """The line a GPU run prints (the CPU cannot take the cuDNN path): the
    engine from explain(), the counts from frontend_stats()."""
    ex = load("attention_verdict.py")
    first_call = ex["FirstAttentionCall"]()
    first_call.stock = False
    first_call.plan = {"route": "cudnn", "reason": "PyTorch picks cuDNN",
                       "pytorch_choice": "cudnn_attention", "plan": "padding_mask+pad_keys_backward",
                       "rule": "key_tail_nan_dq_9.19", "engine": "cudnn_frontend"}
    stats = dict(openwam_sdpa.frontend_stats(), score_shift_backwards=3, padding_mask_backwards=4,
                 aten_fallback_calls=1)
    assert ex["verdict"]([], 2, first_call, stats) == (
        "verdict: finite: loss and gradients finite in all 2 steps; attention: openwam_sdpa, "
        "route cudnn (PyTorch picks cuDNN), plan padding_mask+pad_keys_backward, "
        "rule key_tail_nan_dq_9.19, engine cudnn_frontend; calls on shifted scores: 3, "
        "with cuDNN's padding mask: 4, calls on the ATen fallback: 1")
    # No rule, and the build without the frontend: ATen's cuDNN attention.
    first_call.plan = dict(first_call.plan, plan="padding_mask", rule="", engine="aten_cudnn")
    stats = dict(stats, score_shift_backwards=0, padding_mask_backwards=0, aten_fallback_calls=0)
    line = ex["verdict"]([1], 2, first_call, stats)
    assert VERDICT.match(line), line
    assert line.endswith("attention: openwam_sdpa, route cudnn (PyTorch picks cuDNN), plan "
                         "padding_mask, engine aten_cudnn; calls on shifted scores: 0, "
                         "with cuDNN's padding mask: 0, calls on the ATen fallback: 0"), line


@pytest.mark.parametrize("name", ["train_hf.py", "train_patch.py"])
def test_the_documented_cpu_command_runs(name, monkeypatch, capsys):
    """The docstring's own CPU command line, as written there."""
    if name == "train_hf.py":
        pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    doc = load(name)["__doc__"]
    commands = [line.split("#")[0].split() for line in doc.splitlines()
                if line.strip().startswith(f"python examples/{name}")]
    assert len(commands) >= 3, doc
    cpu = [c for c in commands if "--device" in c and c[c.index("--device") + 1] == "cpu"]
    assert len(cpu) == 1, commands
    out, _ = run_example(name, cpu[0][2:], monkeypatch, capsys)
    steps = int(cpu[0][cpu[0].index("--steps") + 1])
    assert_trains(out, steps)
    verdict_of(out, steps)


def test_the_hf_extra_installs_transformers():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    pyproject = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["hf"] == ["transformers"]
    doc = (EXAMPLES / "train_hf.py").read_text()  # without importing transformers
    assert 'pip install --no-build-isolation ".[hf]"' in doc.split('"""')[1]


@pytest.mark.parametrize("name,args,error", [
    ("train_patch.py", ["--seq", "1"], "--seq must be at least 2"),
    ("train_patch.py", ["--batch", "0"], "--batch must be at least 1, got 0"),
    ("train_patch.py", ["--heads", "5"], "--dim (512) must be a positive multiple of --heads (5)"),
    ("train_hf.py", ["--hidden", "20", "--heads", "4"], "--hidden / --heads (20 / 4) must be even"),
    ("train_hf.py", ["--hidden", "640", "--heads", "5"],
     "--heads (5) must be a multiple of the key/value heads (2)"),
    ("train_hf.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_sizes_the_model_cannot_take_are_usage_errors(name, args, error, monkeypatch, capsys):
    """argparse's usage error, before any model is built (review: a reshape's
    traceback, or a NaN loss over no labels that the verdict blamed on training)."""
    if name == "train_hf.py":
        pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    with pytest.raises(SystemExit) as exit_info:
        run_example(name, ["--device", "cpu", *args], monkeypatch, capsys)
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err
