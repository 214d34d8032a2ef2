"""`python -m openwam_sdpa`: help, version, exit codes, and the explain and
guards commands on a machine without a GPU (tests/gpu/test_cli_gpu.py runs
explain on a GPU). A few runs are child processes, as a user types them; the
rest call cli.main in this process."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import subprocess
import sys

import pytest
import torch

import openwam_sdpa
from openwam_sdpa import cli, doctor

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
VERDICTS = (doctor.EXIT_OK, doctor.EXIT_AFFECTED, doctor.EXIT_BROKEN)


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "openwam_sdpa", *args], capture_output=True,
                          text=True, timeout=300)


def run_main(capsys, *args):
    """(exit code, stdout, stderr) of cli.main in this process."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own exits
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def explain_json(capsys, *args):
    code, out, err = run_main(capsys, "explain", "--json", *args)
    assert code == doctor.EXIT_OK, err
    return json.loads(out)


# ------------------------------------------------------------------ help, version, exit codes


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_commands_and_the_exit_codes(flag):
    r = run_module(flag)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m openwam_sdpa"), r.stdout
    for command in ("doctor", "explain", "guards"):
        assert re.search(rf"^\s+{command}\s+\S", r.stdout, re.M), (command, r.stdout)
    # The epilog's table names each code once, with the constants' values.
    codes = dict(re.findall(r"^  (\d)  (.+)$", r.stdout.split("exit codes:")[1], re.M))
    assert set(codes) == {str(c) for c in (*VERDICTS, cli.EXIT_USAGE, cli.EXIT_ERROR)}, codes
    assert codes[str(cli.EXIT_USAGE)].startswith("usage error")
    assert "affected" in codes[str(doctor.EXIT_AFFECTED)]
    assert "non-finite" in codes[str(doctor.EXIT_BROKEN)]


def test_version():
    r = run_module("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"openwam_sdpa {openwam_sdpa.__version__} (torch {torch.__version__}"), r.stdout
    assert "cuDNN runtime" in r.stdout and r.stdout.count("\n") == 1
    kernels = "with" if openwam_sdpa.build_info()["with_cuda"] else "without"
    assert f"{kernels} CUDA kernels" in r.stdout, r.stdout


def test_version_is_the_installed_distribution():
    assert importlib.metadata.version("openwam_sdpa") == openwam_sdpa.__version__


def test_without_a_command_help_goes_to_stderr_with_the_usage_code():
    r = run_module()
    assert r.returncode == cli.EXIT_USAGE == 2
    assert r.stdout == "" and "doctor" in r.stderr and "exit codes:" in r.stderr


def test_usage_errors_never_reuse_a_verdicts_code(capsys):
    # Nor does Python's code for an uncaught error (an extension built for
    # another torch raises at import): a script can tell a crash from AFFECTED.
    assert cli.EXIT_USAGE not in VERDICTS and len(set(VERDICTS)) == 3
    assert cli.EXIT_ERROR == 1 and cli.EXIT_ERROR not in VERDICTS
    for args in (["bogus"], ["doctor", "--bogus"], ["explain", "--heads", "0"],
                 ["explain", "--dtype", "int8"], ["guards", "--cudnn", "nine"]):
        code, out, err = run_main(capsys, *args)
        assert code == cli.EXIT_USAGE, (args, code)
        assert "error:" in err and out == "", args


def test_an_option_before_the_command_says_where_it_goes(capsys):
    """`--json doctor` had been refused as an unrecognized argument under a
    usage line that lists --json (found in review)."""
    code, out, err = run_main(capsys, "--json", "doctor")
    assert code == cli.EXIT_USAGE and out == ""
    assert err.rstrip().endswith("error: --json goes after the command: doctor --json"), err


def test_the_doctor_documents_the_same_codes():
    text = doctor.__doc__
    assert re.search(rf"^  {doctor.EXIT_OK}  nothing to do", text, re.M)
    assert re.search(rf"^  {cli.EXIT_ERROR}  the command failed", text, re.M)
    assert re.search(rf"^  {doctor.EXIT_AFFECTED}  this stack is affected", text, re.M)
    assert re.search(rf"^  {cli.EXIT_USAGE}  usage error", text, re.M)
    assert re.search(rf"^  {doctor.EXIT_BROKEN}  openwam_sdpa itself gave non-finite", text, re.M)


@NO_GPU
def test_doctor_runs_through_the_cli(capsys):
    code, out, _ = run_main(capsys, "doctor", "--json")
    facts = json.loads(out)
    assert code == facts["exit_code"] == doctor.EXIT_OK and facts["gpu"] is None


def test_json_lists_numbers_on_one_line():
    obj = {"remainders": list(range(1, 128)), "empty": [], "nested": {"floats": [-1.5, 2e-07, 3.0]},
           "pairs": [[1, 2], [3]]}
    text = cli.to_json(obj)
    assert json.loads(text) == obj
    for line in text.splitlines():  # no number stands on a line of its own
        assert not re.fullmatch(r"\s*-?\d[\d.eE+-]*,?", line), text
    assert ' "remainders": [1, 2, 3, ' in text and '"floats": [-1.5, 2e-07, 3.0]' in text


def test_json_leaves_other_lists_and_strings_as_they_are():
    """Only lists of numbers alone are joined: a string that looks like one
    (JSON escapes its newlines) and a list holding anything else keep
    json.dumps' own layout. A non-finite float becomes a string (JSON has
    none)."""
    obj = {"mixed": [1, "two", [3, 4]], "text": "[\n 1,\n 2\n]", "inf": [float("inf"), 1]}
    text = cli.to_json(obj)
    assert json.loads(text) == dict(obj, inf=["inf", 1])
    assert '"mixed": [\n  1,\n  "two",\n  [3, 4]\n ]' in text


# ------------------------------------------------------------------ explain


def test_explain_answers_as_the_op_does_for_real_tensors(capsys):
    """The fake tensors the command builds get the answer real tensors get."""
    args = ["--batch", "2", "--heads", "4", "--kv-heads", "2", "--q-len", "7", "--kv-len", "9",
            "--head-dim", "16", "--dtype", "fp32", "--mask", "bool", "--device", "cpu"]
    got = explain_json(capsys, *args)
    q = torch.zeros(2, 4, 7, 16, requires_grad=True)
    k = v = torch.zeros(2, 2, 9, 16)
    mask = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    want = openwam_sdpa.explain(q, k, v, mask, 0.0, False, scale=None, enable_gqa=True)
    assert {key: got[key] for key in want} == want
    assert got["call"] == dict(batch=2, heads=4, kv_heads=2, q_len=7, kv_len=9, head_dim=16,
                               value_head_dim=16, dtype="fp32", mask="bool", causal=False,
                               dropout=0.0, scale=None, enable_gqa=True, differentiated=True,
                               device="cpu")


def test_explain_allocates_nothing(capsys):
    """256 GiB of query in fp32, on a machine with far less: fake tensors."""
    got = explain_json(capsys, "--batch", "64", "--heads", "64", "--q-len", "65536",
                       "--head-dim", "256", "--dtype", "fp32", "--device", "cpu")
    assert got["call"]["q_len"] == got["call"]["kv_len"] == 65536
    assert got["route"] == "pytorch" and got["reason"] == "inputs are not on a CUDA device"


def test_explain_options_reach_the_call(capsys):
    got = explain_json(capsys, "--causal", "--dropout", "0.125", "--scale", "0.5", "--inference",
                       "--value-head-dim", "64", "--mask", "none", "--device", "cpu")
    c = got["call"]
    assert (c["causal"], c["dropout"], c["scale"], c["differentiated"]) == (True, 0.125, 0.5, False)
    assert c["value_head_dim"] == 64 and c["head_dim"] == 128 and not c["enable_gqa"]
    assert got["differentiated"] is False  # the op saw a call without gradients


@NO_GPU
def test_explain_for_cuda_without_a_gpu_says_why_and_what_the_table_says(capsys):
    got = explain_json(capsys, "--q-len", "307", "--kv-len", "320", "--head-dim", "96",
                       "--device", "cuda")
    assert not got["cuda_available"] and got["route"] == "pytorch"
    assert any(n.startswith("no CUDA GPU here") for n in got["notes"]), got["notes"]
    shipped = doctor.shipped_cudnn(torch.__version__)
    if shipped is None:
        assert got["shipped_cudnn_key_tail"] is None
    else:
        assert got["shipped_cudnn_key_tail"]["hit"] == openwam_sdpa.key_tail_defect(shipped, 320, 96)
    code, text, _ = run_main(capsys, "explain", "--device", "cuda")
    assert code == 0 and "note: no CUDA GPU here" in text


@NO_GPU
def test_explain_for_cuda_without_a_gpu_warns_nothing():
    """README's explain example on a machine without a GPU: no warning. A
    CPU-only extension warns at a CUDA call only where torch has a GPU,
    where it has no fix to give (review: it had warned for fake tensors)."""
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "openwam_sdpa", "explain", "--batch", "2", "--heads",
         "16", "--kv-heads", "4", "--q-len", "307", "--kv-len", "320", "--head-dim", "96",
         "--dtype", "bf16", "--mask", "bool", "--device", "cuda"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "built without CUDA" not in result.stdout


@NO_GPU
def test_explain_for_cuda_when_fake_cuda_tensors_fail(capsys, monkeypatch):
    """A torch that cannot fake a CUDA device here: meta tensors, said so."""
    import torch._subclasses.fake_tensor as fake_tensor

    class Failing:
        def __enter__(self):
            raise RuntimeError("no CUDA driver")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(fake_tensor, "FakeTensorMode", Failing)
    got = explain_json(capsys, "--device", "cuda")
    assert got["route"] == "pytorch" and got["reason"] == "inputs are not on a CUDA device"
    assert got["notes"][0].startswith("fake CUDA tensors failed here (RuntimeError: no CUDA driver)")
    assert got["call"]["device"] == "cuda"
    with pytest.raises(RuntimeError, match="no CUDA driver"):  # nothing to fall back to on the CPU
        cli.main(["explain", "--device", "cpu"])


def test_explain_report(capsys):
    code, out, _ = run_main(capsys, "explain", "--batch", "2", "--heads", "16", "--kv-heads", "4",
                            "--q-len", "307", "--kv-len", "320", "--head-dim", "96",
                            "--mask", "additive", "--dropout", "0.1", "--device", "cpu")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("openwam_sdpa explain: query [2, 16, 307, 96], key/value [2, 4, 320, 96], "
                        "bf16 on cpu; additive bf16 mask, dropout 0.1, enable_gqa, with gradients")
    fields = [line.split()[0] for line in lines[1:8]]
    assert fields == ["route", "PyTorch", "plan", "guard", "reason", "cuDNN", "settings"]
    assert lines[1].startswith("  route           pytorch: PyTorch's own")


POSITIVE = "expected a positive integer up to 2147483647 (1, 2, ...)"


@pytest.mark.parametrize("args,message", [
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
    (["--q-len", "-3"], f"argument --q-len: {POSITIVE}, got '-3'"),
    (["--batch", "x"], f"argument --batch: {POSITIVE}, got 'x'"),
    (["--batch", "2.5"], f"argument --batch: {POSITIVE}, got '2.5'"),
    (["--batch", "99999999999999999999"], f"argument --batch: {POSITIVE}, got '99999999999999999999'"),
    (["--batch", "2147483647", "--heads", "2147483647", "--q-len", "2147483647"],
     "more than PyTorch can index (2**63 - 1)"),
    (["--mask", "float"], "invalid choice"),
])
def test_explain_argument_errors(capsys, args, message):
    code, _, err = run_main(capsys, "explain", *args)
    assert code == cli.EXIT_USAGE and message in err, err
    assert "usage: python -m openwam_sdpa explain" in err
    assert "positive_int" not in err  # argparse names the type function where it fails


def test_explain_answers_for_a_mask_with_is_causal(capsys):
    """F.sdpa's answer to attn_mask with is_causal=True depends on its backend
    (the CPU's takes it); the op hands such a call to PyTorch, and says so."""
    answer = explain_json(capsys, "--causal", "--mask", "bool", "--device", "cpu")
    assert answer["route"] == "pytorch" and answer["call"]["causal"], answer


def test_explain_json_is_strict_json(capsys):
    """JSON has no NaN: a non-finite --scale is written as a string."""
    code, out, err = run_main(capsys, "explain", *EXPLAINED, "--scale", "nan", "--json")
    assert code == 0, err

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(out, parse_constant=refuse)["call"]["scale"] == "nan"


PAD_ERROR = ("openwam::sdpa: environment variable OPENWAM_SDPA_PAD must be 'auto', 'always' or "
             "'never', got 'sometimes'")
VARLEN_ERROR = ("openwam::sdpa_varlen: environment variable OPENWAM_SDPA_VARLEN must be 'auto', "
                "'flash', 'cudnn' or 'block_diagonal', got 'sometimes'")


@pytest.mark.parametrize("command,variable,error", [
    ("doctor", "OPENWAM_SDPA_PAD", PAD_ERROR),
    ("explain", "OPENWAM_SDPA_PAD", PAD_ERROR),
    # (the doctor had passed a bad varlen engine, on which every varlen_sdpa call raises)
    ("doctor", "OPENWAM_SDPA_VARLEN", VARLEN_ERROR),
    # explain describes a dense call, which never reads the varlen engine: the
    # op runs it (review: explain had refused it)
    ("explain", "OPENWAM_SDPA_VARLEN", None),
])
def test_a_bad_setting_is_one_line_and_the_usage_code(command, variable, error):
    """Every call of the op that reads a bad OPENWAM_SDPA_* value raises; the
    commands that read the settings say so in one line and exit 2, not with a
    traceback and the doctor's 'affected' code."""
    import os

    env = dict(os.environ, **{variable: "sometimes"})
    result = subprocess.run([sys.executable, "-m", "openwam_sdpa", command], capture_output=True,
                            text=True, timeout=300, env=env)
    if error is None:
        assert result.returncode == 0 and "openwam_sdpa explain:" in result.stdout, result.stderr
        assert "sometimes" not in result.stderr, result.stderr
        return
    assert result.returncode == cli.EXIT_USAGE and result.stdout == "", result.stderr
    assert result.stderr.strip().splitlines() == [
        f"python -m openwam_sdpa {command}: error: {error}"], result.stderr


@pytest.mark.parametrize("command", ["doctor", "explain", "guards"])
def test_every_option_has_help(capsys, command):
    import argparse

    commands = next(a for a in cli.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices[command]._actions:
        assert action.help, (command, action.option_strings)
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    if command == "explain":
        assert re.search(r"^  --batch N +batch size", capsys.readouterr().out, re.M)


EXPLAINED = ["--batch", "2", "--heads", "2", "--q-len", "3", "--head-dim", "8", "--dtype", "fp32",
             "--device", "cpu"]


def f_sdpa_outcome(**scalars):
    """F.sdpa's own outcome for a call of EXPLAINED's shapes on the CPU."""
    q = torch.randn(2, 2, 3, 8)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, **scalars)
    except Exception as e:  # noqa: BLE001 - its error, whatever the type
        return e
    return None


@pytest.mark.parametrize("dropout", ["1.5", "-1", "nan", "1.0000001"])
def test_explain_refuses_a_dropout_f_sdpa_refuses(capsys, dropout):
    error = f_sdpa_outcome(dropout_p=float(dropout))
    assert isinstance(error, RuntimeError), f"F.sdpa takes dropout_p={dropout} here: {error}"
    code, out, err = run_main(capsys, "explain", *EXPLAINED, "--dropout", dropout)
    assert code == cli.EXIT_USAGE and out == "", err
    assert err.rstrip().endswith(
        f"error: F.scaled_dot_product_attention rejects dropout_p={float(dropout)}: {error}"), err


@pytest.mark.parametrize("args,scalars", [
    (["--scale", "nan"], {"scale": float("nan")}),
    (["--scale", "-2"], {"scale": -2.0}),
    (["--scale", "-1e-3"], {"scale": -1e-3}),  # argparse alone read it as an option
    (["--scale", "-inf"], {"scale": float("-inf")}),
    (["--dropout", "1"], {"dropout_p": 1.0}),
    (["--dropout", "0.25", "--causal"], {"dropout_p": 0.25, "is_causal": True}),
])
def test_explain_takes_what_f_sdpa_takes(capsys, args, scalars):
    assert f_sdpa_outcome(**scalars) is None  # F.sdpa takes them
    code, out, err = run_main(capsys, "explain", *EXPLAINED, *args, "--json")
    assert code == 0, err
    call = json.loads(out)["call"]
    assert call["dropout"] == scalars.get("dropout_p", 0.0)
    scale = scalars.get("scale")
    assert call["scale"] == (scale if scale is None or math.isfinite(scale) else str(scale))


def explained_rules(capsys, *args):
    got = explain_json(capsys, "--device", "cuda", "--head-dim", "96", *args)
    rules, notes = got["shipped_cudnn_rules"], got["notes"]
    for name in rules:  # the note names every rule that covers the call
        assert sum(name + " covers this call" in n for n in notes) == 1, (name, notes)
    return set(rules), notes


@NO_GPU
def test_explain_for_cuda_without_a_gpu_names_every_rule_that_covers_the_call(capsys):
    """Batch 1 with one query row: the one-query-row rows cover the call as
    well as the key-tail ones; they go away at batch 2 or with two query
    rows, and no rule applies without gradients."""
    shipped = doctor.shipped_cudnn(torch.__version__)
    if shipped is None:
        pytest.skip(f"torch {torch.__version__} ships no known cuDNN")
    one_row, _ = explained_rules(capsys, "--batch", "1", "--q-len", "1", "--kv-len", "320")
    batch_2, _ = explained_rules(capsys, "--batch", "2", "--q-len", "1", "--kv-len", "320")
    two_rows, _ = explained_rules(capsys, "--batch", "1", "--q-len", "2", "--kv-len", "320")
    assert batch_2 == two_rows and batch_2 < one_row, (one_row, batch_2, two_rows)
    in_range = {r["name"] for r in openwam_sdpa.guard_rules()
                if r["first_version"] <= shipped < r["end_version"]}
    assert one_row <= in_range
    # The key-tail rows are the ones the table's key-tail query names.
    key_tail = openwam_sdpa.key_tail_defect(shipped, 320, 96)
    assert bool(batch_2) == key_tail
    tile, _ = explained_rules(capsys, "--batch", "1", "--q-len", "1", "--kv-len", "384")
    assert tile == one_row - batch_2  # s_kv % 128 == 0: the key-tail rows go, the others stay
    none, notes = explained_rules(capsys, "--batch", "1", "--q-len", "1", "--kv-len", "320",
                                  "--inference")
    assert none == set() and any("no rule applies to a call without gradients" in n for n in notes)
    # With dropout the call takes the plan without gradients too (its dropout
    # pattern must not depend on the grad mode); cuDNN takes multiples of 1/16.
    args = ("--batch", "2", "--q-len", "2", "--kv-len", "320", "--dropout", "0.125")
    trained, _ = explained_rules(capsys, *args)
    dropped, notes = explained_rules(capsys, *args, "--inference")
    assert dropped == trained == batch_2, (dropped, trained, batch_2)
    assert any("with dropout: " in n for n in notes) == key_tail, notes


@NO_GPU
@pytest.mark.parametrize("args,why", [
    (("--dtype", "fp32"), "dtype is not float16/bfloat16"),
    (("--head-dim", "100"), "head_dim is not a multiple of 8 up to 256"),
    (("--q-len", "1", "--dropout", "0.1"), "dropout with s_q == 1"),
])
def test_explain_for_cuda_without_a_gpu_names_no_rule_where_cudnn_cannot_serve(capsys, args, why):
    """A call the cuDNN path refuses goes to PyTorch on a GPU, with no plan:
    the shipped cuDNN's table names no rule for it (it had named the key-tail
    rows for fp32 calls; found in review)."""
    if doctor.shipped_cudnn(torch.__version__) is None:
        pytest.skip(f"torch {torch.__version__} ships no known cuDNN")
    rules, notes = explained_rules(capsys, "--batch", "1", "--kv-len", "320", *args)
    assert rules == set()
    assert any(f"the cuDNN path cannot take this call ({why}): no rule applies" in n
               for n in notes), notes


@pytest.mark.parametrize("batch,q_len,kv_len", [(1, 1, 320), (1, 1, 384), (2, 1, 320), (1, 2, 704)])
@pytest.mark.parametrize("cudnn", [91900, 92000, 92600, 92700])
def test_guard_hits_agree_with_the_tables_own_queries(batch, q_len, kv_len, cudnn):
    """The rows guard_hits names for a call agree with key_tail_defect, the
    table's own key-tail query, and lie in their version ranges."""
    from openwam_sdpa import _C

    q = torch.empty(batch, 8, q_len, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(batch, 8, kv_len, 128, dtype=torch.bfloat16, device="meta")
    hits = _C.guard_hits(q, k, k, None, 0.0, False, None, False, cudnn)
    assert hits["planned"]
    names = hits["rules"]
    rows = {r["name"]: r for r in openwam_sdpa.guard_rules()}
    assert all(rows[n]["first_version"] <= cudnn < rows[n]["end_version"] for n in names)
    assert any(n.startswith("key_tail") for n in names) == openwam_sdpa.key_tail_defect(
        cudnn, kv_len, 128)
    # Without gradients and dropout no plan, so no rule; with dropout a plan.
    inference = q.detach()
    assert _C.guard_hits(inference, k, k, None, 0.0, False, None, False, cudnn) == \
        {"planned": False, "cudnn_rejects": None, "rules": []}
    dropped = _C.guard_hits(inference, k, k, None, 0.125, False, None, False, cudnn)
    if q_len == 1:  # the cuDNN path takes no dropout with one query row
        assert dropped == {"planned": True, "cudnn_rejects": "dropout with s_q == 1", "rules": []}
    else:
        assert dropped == hits


# ------------------------------------------------------------------ guards


@pytest.mark.parametrize("text,version", [("9.19.0", 91900), ("9.19", 91900), ("91900", 91900),
                                          ("9.26.1", 92601), ("10.0", 100000),
                                          ("9.19.0.56", 91900), ("9.26.0.51", 92600)])
def test_cudnn_versions(text, version):
    assert cli.cudnn_version(text) == version


@pytest.mark.parametrize("text", ["9", "nine", "9.x", "9.100.0", "9.19.0.x", "9.19.0.-1",
                                  "9.19.0.-0", "9.19.0.+5", "9.19.0. 56", "9.19.0.5_6",
                                  "9.19.0.56.1", "9.19..56", "-9.19", "100.0",
                                  "3000000000", "99999999999999999999"])
def test_bad_cudnn_versions(text):
    with pytest.raises(Exception, match="expected a cuDNN version"):
        cli.cudnn_version(text)


def guards_json(capsys, *args):
    code, out, err = run_main(capsys, "guards", "--json", *args)
    assert code == 0, err
    return json.loads(out)


# ragged_unmeasured (after 9.19.0) and ragged_unmeasured_old (before) keep sdpa_varlen's
# cuDNN engine off everywhere but 9.19.0, where it was measured (and kept to three
# head_dims by ragged_adversarial_dq_9.19).
@pytest.mark.parametrize("cudnn,applying,status", [
    # On 9.19.0 the general rows cover what the measured ones do not reach.
    ("9.19.0", {"key_tail_nan_dq_9.19", "key_tail_nan_dq", "sq1_nan_dk_dv_9.19",
                "sq1_nan_dk_dv", "ragged_adversarial_dq_9.19"}, "measured"),
    ("9.20.0", {"key_tail_nan_dq", "sq1_nan_dk_dv", "ragged_unmeasured"}, "conservative"),
    ("9.26.0", {"bhsq1_backward_plan_segfault", "sq1_nan_dk_dv", "ragged_unmeasured"}, "fixed"),
    # Newer than the table knows: the rows of defects with no known fix stay.
    ("9.27.0", {"bhsq1_backward_plan_segfault", "sq1_nan_dk_dv", "ragged_unmeasured"},
     "unverified"),
])
def test_guards_for_a_given_cudnn(capsys, cudnn, applying, status):
    table = guards_json(capsys, "--cudnn", cudnn)
    assert table["cudnn"] == cli.cudnn_version(cudnn) and table["cudnn_source"] == "given"
    assert table["status"] == status
    assert [r["name"] for r in table["rules"]] == [r["name"] for r in openwam_sdpa.guard_rules()]
    assert {r["name"] for r in table["rules"] if r["applies"]} == applying
    for r in table["rules"]:
        # Every row in range applies; a row of the same defect that comes
        # first stands in front of it.
        assert r["applies"] == r["in_range"], r
        first = next(f["name"] for f in table["rules"] if f["applies"]
                     and doctor.defect_of(f["name"]) == doctor.defect_of(r["name"])) \
            if r["applies"] else None
        assert r["behind"] == (first if first != r["name"] else None), r
        assert r["measured"] == (r["applies"] and r["measured_first_version"] <= table["cudnn"]
                                 < r["measured_end_version"]), r


@NO_GPU
def test_guards_without_a_gpu_read_the_shipped_cudnn(capsys):
    table = guards_json(capsys)
    shipped = doctor.shipped_cudnn(torch.__version__)
    assert table["cudnn_runtime"] == 0
    assert table["cudnn_source"] == ("shipped" if shipped else "none")
    assert table["cudnn"] == (shipped or 0)
    assert table["summary"] == doctor.coverage(shipped or 0)["summary"]


@NO_GPU
def test_guards_without_any_cudnn_put_no_row_in_range(capsys, monkeypatch):
    """No cuDNN loaded and a torch that is no known pair: version 0, which no
    row's range holds (rows from version 0 on had said in_range)."""
    monkeypatch.setattr(doctor, "shipped_cudnn", lambda version: None)
    table = guards_json(capsys)
    assert table["cudnn"] == 0 and table["cudnn_source"] == "none"
    assert not any(r["in_range"] or r["applies"] for r in table["rules"])


def test_guards_report(capsys):
    code, out, _ = run_main(capsys, "guards", "--cudnn", "9.19.0")
    assert code == 0
    assert out.startswith("openwam_sdpa guards: cuDNN 9.19.0 (given with --cudnn)\n  measured rule")
    for rule in openwam_sdpa.guard_rules():
        assert f" {rule['name']}  [" in out and rule["source"] in out
    assert "* key_tail_nan_dq_9.19  [applies, measured]" in out
    assert "* key_tail_nan_dq  [applies, where key_tail_nan_dq_9.19 above does not]" in out
    assert "- bhsq1_backward_plan_segfault  [does not apply]" in out
