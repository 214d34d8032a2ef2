"""`python -m openwam_sdpa doctor` on a machine without a GPU, its two cases
run on the CPU, its verdict logic on made-up GPU facts, and what it says
about each known torch/cuDNN pair (the GPU run is tests/gpu/test_doctor_gpu.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from openwam_sdpa import build_info, doctor, key_tail_defect

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="checks the no-GPU report; tests/gpu/test_doctor_gpu.py covers GPUs")


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "openwam_sdpa", *args], capture_output=True,
                          text=True, timeout=300)


@NO_GPU
def test_doctor_without_gpu_says_what_it_could_not_check():
    r = run_module("doctor")
    assert r.returncode == doctor.EXIT_OK, r.stdout + r.stderr
    assert f"torch            {torch.__version__}" in r.stdout
    assert "known pair" in r.stdout and "guard table      cuDNN" in r.stdout
    assert "not checked: no CUDA GPU" in r.stdout
    assert "adversarial case" not in r.stdout  # nothing ran
    assert r.stdout.rstrip().splitlines()[-1].startswith("verdict: not affected here: no CUDA GPU")


@NO_GPU
def test_doctor_json():
    r = run_module("doctor", "--json")
    assert r.returncode == doctor.EXIT_OK, r.stderr
    facts = json.loads(r.stdout)
    assert facts["torch"] == torch.__version__
    assert facts["gpu"] is None and facts["exit_code"] == doctor.EXIT_OK
    assert facts["not_checked"]
    assert facts["known_pair"]["shipped"] == doctor.shipped_cudnn(torch.__version__)
    assert facts["coverage"]["status"] in ("none", "measured", "conservative", "fixed", "unverified")
    assert "left_padding_nonfinite" not in facts
    # A list of numbers takes one line (the conservative rule's remainders
    # 1..127 would take 127).
    remainders = facts["coverage"]["remainders"]
    lines = r.stdout.splitlines()
    assert all(not line.strip().rstrip(",").lstrip("-").isdigit() for line in lines), r.stdout
    if remainders:
        assert f'"remainders": {json.dumps(remainders)}' in r.stdout


def test_exit_codes_are_distinct_and_leave_argparse_its_2():
    """2 is argparse's usage error: a bad command line never reads as a verdict."""
    codes = (doctor.EXIT_OK, doctor.EXIT_AFFECTED, doctor.EXIT_BROKEN)
    assert len(set(codes)) == 3 and 2 not in codes
    r = run_module("doctor", "--no-such-option")
    assert r.returncode == 2 and "usage: python -m openwam_sdpa doctor" in r.stderr


# ------------------------------------------------------------------ the two cases


def test_adversarial_row_is_below_the_float32_exp_limit():
    """The adversarial case is only a test if its rows have lse < -88.7
    (where exp() underflows in float32); random data never gets there."""
    c = doctor.ADVERSARIAL
    adv = doctor.adversarial_case("cpu", torch.float64)
    lse = torch.logsumexp(adv.query @ adv.key.transpose(-2, -1) / math.sqrt(c["head_dim"]), dim=-1)
    assert adv.affected[..., 0].all() and adv.affected.sum() == c["batch"] * c["heads"]
    assert lse[adv.affected].max().item() < -88.7
    assert lse[~adv.affected].min().item() > -20.0


def test_left_padded_case_has_fully_masked_rows_at_an_affected_length():
    """The trigger is the padding's query rows, which see no key, at a key
    length the measured rule marks affected (704 % 128 == 64)."""
    c = doctor.LEFT_PADDED
    q, k, v, grad_out, mask = doctor.left_padded_case("cpu", torch.float32)
    assert q.shape == k.shape == grad_out.shape == (c["batch"], c["heads"], c["s"], c["head_dim"])
    assert mask.dtype == torch.bool and mask.shape == (c["batch"], 1, c["s"], c["s"])
    empty = ~mask.any(-1)  # [B, 1, s]
    assert empty.sum() == c["padding"] and empty[-1, 0, :c["padding"]].all()
    assert key_tail_defect(91900, c["s"], c["head_dim"])


def test_cases_run_on_the_cpu():
    """The code path the GPU takes, on the CPU (no cuDNN here: all finite)."""
    facts = doctor.run_cases("cpu")
    assert facts["adversarial_lse"] < -88.7
    assert set(facts["adversarial_nonfinite"]) == {
        "stock F.sdpa, bool mask", "openwam_sdpa, bool mask",
        "stock F.sdpa, no mask", "openwam_sdpa, no mask"}
    assert set(facts["left_padding_nonfinite"]) == {"stock F.sdpa", "openwam_sdpa"}
    runs = [*facts["adversarial_nonfinite"].values(), *facts["left_padding_nonfinite"].values()]
    assert all(counts == {"q": 0, "k": 0, "v": 0} for counts in runs), runs
    assert facts["left_padding_default_backend"] == facts["left_padding_plan"]["pytorch_choice"]
    json.dumps(facts)  # --json prints these as they are


# ------------------------------------------------------------------ verdict and report


def gpu_facts(stock=0, ours=0, stock_lp=0, ours_lp=0, cudnn=91900):
    counts = lambda n: {"q": n, "k": 0, "v": 0}  # noqa: E731
    plan = {"backend": "cudnn", "plan": "padding_mask+pad_keys_backward",
            "pytorch_choice": "cudnn_attention"}
    return {
        "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn_compiled": cudnn, "cudnn_runtime": cudnn,
        "built_for_torch": "2.11.0+cu130", "extension_has_cuda": True, "gpu": "H200 (sm90)",
        "known_pair": doctor.known_pair("2.11.0+cu130", cudnn), "coverage": doctor.coverage(cudnn),
        "coverage_of": "runtime", "not_checked": [],
        "settings": {"cudnn": "follow_pytorch", "pad": "auto", "check_finite": False},
        "openwam_plan": plan, "pytorch_default_backend": "cudnn_attention", "adversarial_lse": -103.4,
        "adversarial_nonfinite": {
            "stock F.sdpa, bool mask": counts(stock),
            "openwam_sdpa, bool mask": counts(ours),
        },
        "left_padding_plan": plan, "left_padding_default_backend": "cudnn_attention",
        "left_padding_nonfinite": {"stock F.sdpa": counts(stock_lp), "openwam_sdpa": counts(ours_lp)},
    }


@pytest.mark.parametrize("facts,code,start", [
    (gpu_facts(1024, 0, 8192), doctor.EXIT_AFFECTED, "AFFECTED: stock SDPA gave 9216"),
    (gpu_facts(0, 0, 8192), doctor.EXIT_AFFECTED, "AFFECTED: stock SDPA gave 8192"),
    (gpu_facts(), doctor.EXIT_AFFECTED, "AFFECTED: the guard table lists"),
    (gpu_facts(cudnn=92000), doctor.EXIT_AFFECTED, "AFFECTED: the guard table lists"),
    # torch 2.15's cuDNN: no key tail, but the one-query-row rows (no fix known).
    (gpu_facts(cudnn=92600), doctor.EXIT_AFFECTED, "AFFECTED: the guard table lists defects "
     "of this cuDNN that the two cases cannot hit: bhsq1_backward_plan_segfault, sq1_nan_dk_dv "),
    (gpu_facts(cudnn=92700), doctor.EXIT_AFFECTED, "AFFECTED: the guard table lists defects"),
    (gpu_facts(1024, 3), doctor.EXIT_BROKEN, "BROKEN: openwam_sdpa gave 3"),
    (gpu_facts(0, 0, 8192, 5), doctor.EXIT_BROKEN, "BROKEN: openwam_sdpa gave 5"),
    (gpu_facts(0, 0, 64, cudnn=92700), doctor.EXIT_AFFECTED, "AFFECTED: stock SDPA gave 64"),
])
def test_verdict(facts, code, start):
    line, got = doctor.verdict(facts)
    assert got == code and line.startswith(start), line


def test_broken_verdict_names_a_fix_turned_off():
    facts = gpu_facts(1024, 1024)
    facts["settings"]["pad"] = "never"
    line, code = doctor.verdict(facts)
    assert code == doctor.EXIT_BROKEN and "OPENWAM_SDPA_PAD=never turns the fix off" in line


def test_a_build_without_cuda_on_a_gpu_is_broken_and_says_why():
    """A CUDA torch whose extension was built without a CUDA toolkit hands
    every CUDA call to stock F.sdpa: the doctor names the build, not a bug
    to report, and the report's torch line says so."""
    facts = dict(gpu_facts(1024, 1024), extension_has_cuda=False)
    line, code = doctor.verdict(facts)
    assert code == doctor.EXIT_BROKEN and "built without CUDA kernels" in line, line
    assert "please report" not in line
    assert "without CUDA kernels" in doctor.format_report(facts)
    assert "without CUDA kernels" not in doctor.format_report(gpu_facts())


def test_unverified_verdict_says_so():
    line, _ = doctor.verdict(gpu_facts(cudnn=92700))
    assert "cuDNN 9.27.0 is newer than any known" in line and "ragged" not in line


def test_verdicts_without_listed_defects():
    """A cuDNN the table lists nothing for (a made-up table: the real one lists
    the one-query-row defects on every version) is not affected; past the
    newest known version, as far as checked. The ragged rows choose
    sdpa_varlen's engine and never make a stack affected."""
    ragged = {"name": "ragged_unmeasured", "layout": "ragged", "first_version": 0,
              "end_version": 10**6, "measured_first_version": 0, "measured_end_version": 0}
    for cudnn, start in ((92600, "not affected: stock SDPA gave finite gradients and the guard "
                                 "table lists no defect of this cuDNN"),
                         (92700, "not affected as far as checked")):
        facts = dict(gpu_facts(cudnn=cudnn),
                     coverage=doctor.coverage(cudnn, [ragged], newest_known=92699))
        line, code = doctor.verdict(facts)
        assert code == doctor.EXIT_OK and line.startswith(start), line


def test_report_lists_the_gpu_facts():
    text = doctor.format_report(gpu_facts(1024, 0, 8192))
    assert "cuDNN            runtime 9.19.0, compiled 9.19.0" in text
    assert "settings         cudnn=follow_pytorch pad=auto check_finite=False" in text
    assert "known pair       torch 2.11.0's CUDA builds ship cuDNN 9.19" in text
    assert "guard table      cuDNN 9.19.0: measured rule key_tail_nan_dq_9.19 (s_kv % 128 in [64]" in text
    lines = text.splitlines()
    adv = next(i for i, line in enumerate(lines) if "adversarial case" in line)
    assert "lse -103.4" in lines[adv]
    assert lines[adv + 1].split() == "stock F.sdpa, bool mask non-finite dQ 1024 dK 0 dV 0".split()
    padded = next(i for i, line in enumerate(lines) if "left-padded causal batch" in line)
    assert "64 padding tokens" in lines[padded] and "default backend cudnn_attention" in lines[padded]
    assert lines[padded + 1].split() == "stock F.sdpa non-finite dQ 8192 dK 0 dV 0".split()
    assert lines[padded + 2].split() == "openwam_sdpa non-finite dQ 0 dK 0 dV 0".split()


def test_report_without_gpu_names_the_shipped_cudnn():
    facts = dict(gpu_facts(), cudnn_runtime=0, coverage=doctor.coverage(92000), coverage_of="shipped",
                 gpu=None, not_checked=["no CUDA GPU"])
    text = doctor.format_report(facts)
    assert "guard table      cuDNN 9.20 (shipped with this torch; none loaded here): conservative" in text
    assert "adversarial case" not in text


# ------------------------------------------------------------------ known pairs and coverage


@pytest.mark.parametrize("torch_version,cudnn,status", [
    ("2.11.0+cu130", 91900, "measured"),
    ("2.12.1+cu128", 92000, "conservative"),
    ("2.13.0", 92000, "conservative"),
    ("2.14.1+cu130", 92400, "conservative"),
    ("2.15.0+cu130", 92600, "fixed"),
])
def test_each_known_pair(torch_version, cudnn, status):
    assert doctor.shipped_cudnn(torch_version) == cudnn
    pair = doctor.known_pair(torch_version, cudnn)
    assert pair["summary"] == (f"torch {torch_version.split('+')[0]}'s CUDA builds ship cuDNN "
                               f"{doctor.minor_str(cudnn)}")
    cov = doctor.coverage(cudnn)
    assert cov["status"] == status, cov
    if status == "measured":
        assert cov["remainders"] == [64] and "key_tail_nan_dq_9.19" in cov["summary"]
    elif status == "conservative":
        assert cov["remainders"] == list(range(1, 128))
        assert "conservative rule key_tail_nan_dq " in cov["summary"]
    else:
        assert cov["remainders"] == [] and "fixed" in cov["summary"]
        # 9.26 fixed the key tail, but has defects of its own (#1071, #1072).
        sources = " ".join(r["source"] for r in cov["rules"])
        assert "#1071" in sources and "#1072" in sources, cov["rules"]


def test_unknown_torch_and_a_foreign_cudnn():
    assert doctor.shipped_cudnn("2.10.0+cu128") is None
    assert "torch 2.10.0+cu128 is not a known pair (2.11/9.19, 2.12/9.20" in \
        doctor.known_pair("2.10.0+cu128", 91000)["summary"]
    assert doctor.known_pair("2.11.0+cu130", 92001)["summary"] == \
        "torch 2.11.0's CUDA builds ship cuDNN 9.19, but cuDNN 9.20.1 is loaded"
    assert doctor.known_pair("2.11.0+cu130", 91901)["summary"] == \
        "torch 2.11.0's CUDA builds ship cuDNN 9.19"


@pytest.mark.parametrize("cudnn,status", [
    (0, "none"),
    (90701, "conservative"),   # torch 2.7.1's cuDNN: every remainder failed
    (91901, "conservative"),   # a 9.19 patch release nobody measured
    (92501, "conservative"),
    (92699, "fixed"),
    (92700, "unverified"),
    (100000, "unverified"),
])
def test_coverage_of_other_versions(cudnn, status):
    cov = doctor.coverage(cudnn)
    assert cov["status"] == status, cov
    if status == "unverified":
        assert "unverified: newer than the last known cuDNN (9.26)" in cov["summary"]
        # No fix known for these defects: their rows stay (conservative).
        assert {r["name"] for r in cov["rules"]} == {
            "bhsq1_backward_plan_segfault", "sq1_nan_dk_dv", "ragged_unmeasured"}, cov


def test_guard_rows_are_read_by_their_version_ranges():
    """A row applies in [first_version, end_version) and is measured in
    [measured_first_version, measured_end_version); every row that applies
    is listed, and the key-tail summary reads the first, as the guard does."""
    rows = [
        {"name": "key_tail_nan_dq_9.20", "first_version": 92000, "end_version": 92001,
         "measured_first_version": 92000, "measured_end_version": 92001},
        {"name": "key_tail_nan_dq", "first_version": 0, "end_version": 92600,
         "measured_first_version": 0, "measured_end_version": 0},
        {"name": "later_defect", "first_version": 92400, "end_version": 92700,
         "measured_first_version": 92400, "measured_end_version": 92401},
        {"name": "a row without a range"},
    ]
    assert [(r["name"], r["measured"]) for r in doctor.rules_for(92000, rows)] == [
        ("key_tail_nan_dq_9.20", True), ("key_tail_nan_dq", False)]
    assert [(r["name"], r["measured"]) for r in doctor.rules_for(92400, rows)] == [
        ("key_tail_nan_dq", False), ("later_defect", True)]
    assert doctor.rules_for(92700, rows) == []
    cov = doctor.coverage(92000, rows)
    assert cov["status"] == "measured" and "measured rule key_tail_nan_dq_9.20" in cov["summary"]
    assert doctor.coverage(92400, rows)["summary"].endswith("other rules: later_defect (measured)")


def test_rows_of_one_defect_on_the_real_table():
    """On 9.19.0 the measured rows stand in front of the general rows of
    their defect, which cover the calls the measurements did not reach (the
    doctor names both); elsewhere the general rows apply."""
    rules = doctor.ops.guard_rules()
    assert [r["name"] for r in doctor.rules_for(91900, rules)] == [
        "key_tail_nan_dq_9.19", "key_tail_nan_dq", "sq1_nan_dk_dv_9.19", "sq1_nan_dk_dv",
        "ragged_adversarial_dq_9.19"]
    summary = doctor.coverage(91900)["summary"]
    assert summary.startswith("measured rule key_tail_nan_dq_9.19"), summary
    assert summary.endswith("other rules: sq1_nan_dk_dv_9.19 (measured), sq1_nan_dk_dv, "
                            "ragged_adversarial_dq_9.19 (measured)"), summary
    assert [r["name"] for r in doctor.rules_for(92000, rules)] == [
        "key_tail_nan_dq", "sq1_nan_dk_dv", "ragged_unmeasured"]
    assert doctor.defect_of("key_tail_nan_dq_9.19") == doctor.defect_of("key_tail_nan_dq")
    assert doctor.defect_of("bhsq1_backward_plan_segfault") == "bhsq1_backward_plan_segfault"


def test_newest_known_cudnn_comes_from_the_guard_table():
    newest = build_info()["newest_known_cudnn"]
    assert newest // 100 == max(doctor.KNOWN_PAIRS.values()) // 100  # 9.26.x
    assert doctor.coverage(newest)["status"] == "fixed"
    assert doctor.coverage(newest + 1)["status"] == "unverified"
    assert doctor.coverage(92600, newest_known=92599)["status"] == "unverified"
