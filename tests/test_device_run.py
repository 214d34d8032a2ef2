"""tools/device_run.sh's fuzz part, run with a stand-in python that records
each pytest call instead of running it (the GPU machine's script, checked
here on the CPU): both fuzzes split over FUZZ_PROCS processes, the cases
divided evenly, seed FUZZ_SEED + i in process i, the whole file in the first
process and the random draw alone in the others, and the part failing when
one process fails or nothing passed."""

import stat
import subprocess

from support import ROOT

# Records "<dense seed> <dense cases> <varlen seed> <varlen cases> <args>" per
# pytest call; the process whose seed is $FAIL_SEED fails, and with
# ONLY_SKIPS set every process reports skips alone.
FAKE = """#!/bin/sh
case "$*" in
  *pytest*)
    echo "${OPENWAM_FUZZ_SEED:--} ${OPENWAM_FUZZ_CASES:--} ${OPENWAM_VARLEN_FUZZ_SEED:--} ${OPENWAM_VARLEN_FUZZ_CASES:--} $*" >> "$CALLS"
    if [ -n "$ONLY_SKIPS" ]; then echo "6 skipped in 0.1s"; exit 0; fi
    if [ "${OPENWAM_FUZZ_SEED:-${OPENWAM_VARLEN_FUZZ_SEED}}" = "$FAIL_SEED" ]; then
      echo "fuzz: FAILED case 3 (OPENWAM_FUZZ_SEED=$FAIL_SEED)"; echo "1 failed in 0.1s"; exit 1
    fi
    echo "1 passed in 0.1s";;
esac
exit 0
"""


def fuzz_part(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    run = subprocess.run(["bash", "tools/device_run.sh", "fuzz"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin:/usr/local/bin", "PYTHON": str(fake),
                              "OUT": str(tmp_path / "out"), "CALLS": str(calls), **env})
    summary = next(line for line in run.stdout.splitlines() if line.startswith("fuzz    "))
    rows = [line.split(" ", 4) for line in calls.read_text().splitlines()]
    return run.returncode, summary, rows


def test_both_fuzzes_are_split_over_processes_with_consecutive_seeds(tmp_path):
    rc, summary, rows = fuzz_part(tmp_path, FUZZ_PROCS="3", FUZZ_SEED="500", FUZZ_CASES="10",
                                  VARLEN_FUZZ_CASES="4")
    assert rc == 0 and "ok: 6 processes passed (seeds 500..502)" in summary, summary
    dense = sorted((r[0], r[1], r[4]) for r in rows if r[0] != "-")
    varlen = sorted((r[2], r[3], r[4]) for r in rows if r[2] != "-")
    assert [(s, n) for s, n, _ in dense] == [("500", "4"), ("501", "3"), ("502", "3")]
    assert [(s, n) for s, n, _ in varlen] == [("500", "2"), ("501", "1"), ("502", "1")]
    # The first process runs the whole file, the others its random draw.
    assert dense[0][2].split()[-1] == "tests/gpu/test_fuzz_gpu.py"
    assert all(a.split()[-1] == "tests/gpu/test_fuzz_gpu.py::test_fuzz_against_stock"
               for _, _, a in dense[1:])
    assert all(a.split()[-1] ==
               "tests/gpu/test_varlen_fuzz_gpu.py::test_varlen_fuzz_against_stock"
               for _, _, a in varlen[1:])


def test_fewer_cases_than_processes_start_fewer_processes(tmp_path):
    rc, summary, rows = fuzz_part(tmp_path, FUZZ_PROCS="4", FUZZ_SEED="7", FUZZ_CASES="8",
                                  VARLEN_FUZZ_CASES="1")
    assert rc == 0 and "ok: 5 processes passed" in summary, summary
    assert sorted(r[3] for r in rows if r[2] != "-") == ["1"]


def test_one_failing_process_fails_the_part_and_names_its_seed(tmp_path):
    rc, summary, _ = fuzz_part(tmp_path, FUZZ_PROCS="2", FUZZ_SEED="40", FUZZ_CASES="4",
                               VARLEN_FUZZ_CASES="2", FAIL_SEED="41")
    assert rc != 0 and "FAILED" in summary and "dense-41: rc 1" in summary, summary
    assert "varlen-41: rc 1" in summary and "dense-40" not in summary, summary


def test_skips_alone_are_no_pass(tmp_path):
    """On a machine without a GPU the fuzz tests skip: the part must not say ok."""
    rc, summary, _ = fuzz_part(tmp_path, FUZZ_PROCS="2", FUZZ_SEED="1", FUZZ_CASES="2",
                               VARLEN_FUZZ_CASES="2", ONLY_SKIPS="1")
    assert rc != 0 and "FAILED" in summary and "6 skipped" in summary, summary
