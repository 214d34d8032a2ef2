#!/usr/bin/env python3
"""PyTorch's own SDPA tests, plain and under openwam_sdpa.patch(): what breaks only when patched.

PyTorch's test/test_transformers.py is the best available check that
`openwam_sdpa.patch()` is a faithful drop-in for F.scaled_dot_product_attention:
it exercises masks of every rank and dtype, scales, dropout, nested tensors,
CausalBias, autocast, torch.compile, sdpa_kernel restrictions and the error
cases. This script runs a chosen set of its tests twice, in two pytest
processes: once plain, once with patch() applied before the file is imported
(tools/pytorch_sdpa_plugin.py), and reports the tests that fail only when
patched, grouped into families by exception type and the first line of the
message. That list is the to-do list for a faithful drop-in.

The test file is PyTorch's code and is never committed. Put it at
.external/pytorch/test_transformers.py (.external/ is gitignored): the runs so
far used test/test_transformers.py of the pytorch/pytorch repository at commit
00030eb8e81f911c48c4d7634fa6b8bb2fae1a1b (torch 2.5 era) or, where that one
could not be had, the older 6ac86627d419394fc77fd09392046a4bbd44ec9e (no cuDNN
tests); both are recognised by their hashes below. Two modules it imports may
be missing, and this script writes stand-ins for them into the output folder:
test_cpp_extensions_open_device_registration, from PyTorch's test tree (used
only by a class never chosen here), and expecttest, which torch's test
utilities import (a stand-in only where it is not installed).

Usage (from the repository root, openwam_sdpa installed):

    python3 tools/pytorch_sdpa_tests.py --device cpu --out build/pt-cpu
    python3 tools/pytorch_sdpa_tests.py --device cuda --out $OUT/pt   # on a GPU machine,
                                                 # with .external/ copied along

Tests are chosen from the device's instantiated classes (TestSDPACPU, ... or
...CUDA) whose base name matches --classes (globs; default: TestSDPA*,
TestAttnBias, TestTransformers). --sample N picks N of them, stratified by
test function (each function gets one test before any gets a second) with
--seed; the plain run writes the chosen ids and the patched run runs exactly
those. Default sample: all tests on CPU (452; both runs take 2-8 minutes on
a 2-core machine, depending on its load), 600 on CUDA (the CUDA classes hold
~75,000 parametrised tests).

A test that kills the pytest process is recorded as "crashed", one that runs
longer than --test-timeout-s as "hung"; the run then resumes after it. The
two runs share --time-limit-s (default: 480 s on CUDA, where the device tool
stops a command at 600 s; none on CPU): tests a run did not reach are
"not run" and left out of the comparison.

Writes four files to --out (the device tool brings back at most 8 from
$OUT): report.json (every chosen test's outcome in both runs, the families),
report.md, and {plain,patched}.log (pytest's output). Work files (stand-ins,
event logs, the chosen ids) live in a temporary folder.
Exit status: 0 when both runs ran (whatever the tests said); 2 when a test
crashed or hung a pytest process; 3 when a run could not run at all.
"""

import argparse
import collections
import hashlib
import json
import os
import platform
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / ".external" / "pytorch" / "test_transformers.py"
KNOWN_FILES = {  # sha256 -> where the file came from
    "958baa9dc535522161b3ad7987e55d9cb1c30eef6f70a8bffbbe6cfec5c68e83":
        "pytorch/pytorch test/test_transformers.py @ 00030eb8e81f911c48c4d7634fa6b8bb2fae1a1b",
    "10b5568208fd7401218ccd9025c33d6ea25188d73dc8b1e0e521a279eea5a961":
        "pytorch/pytorch test/test_transformers.py @ 6ac86627d419394fc77fd09392046a4bbd44ec9e "
        "(older: no cuDNN or enable_gqa tests)",
}
BAD = ("failed", "error", "crashed", "hung")
OUTCOMES = ("passed", "failed", "error", "skipped", "crashed", "hung", "not run")
MAX_RESUMES = 4

SHIMS = {
    # Only TestSDPAPrivateUse1Only uses these, and it is never chosen: it
    # builds a C++ extension from PyTorch's test tree.
    "test_cpp_extensions_open_device_registration.py": (
        '"""Stand-in for a module of PyTorch\'s test tree (see pytorch_sdpa_tests.py)."""\n'
        "import unittest\n\n\n"
        "def remove_build_path():\n"
        '    raise unittest.SkipTest("needs PyTorch\'s test tree")\n\n\n'
        "def generate_faked_module():\n"
        '    raise unittest.SkipTest("needs PyTorch\'s test tree")\n'),
}
EXPECTTEST_SHIM = (
    # torch.testing._internal.common_utils subclasses expecttest.TestCase and
    # reads expecttest.ACCEPT; test_transformers.py uses no assertExpected*.
    '"""Stand-in for expecttest where it is not installed (see pytorch_sdpa_tests.py)."""\n'
    "import unittest\n\nACCEPT = False\n\n\n"
    "class TestCase(unittest.TestCase):\n    pass\n")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, default=ROOT / "build" / "pytorch_sdpa_tests")
    p.add_argument("--file", type=Path, default=DEFAULT_FILE)
    p.add_argument("--classes", default="TestSDPA*,TestAttnBias,TestTransformers",
                   help="comma-separated base class names (globs)")
    p.add_argument("--sample", type=int, help="tests to pick (0: all; default: all on "
                   "cpu, 600 on cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-timeout-s", type=float, default=300.0)
    p.add_argument("--time-limit-s", type=float,
                   help="budget for both runs together (0: none; default: none on cpu, "
                   "480 on cuda, inside the device tool's 600 s per command)")
    args = p.parse_args()
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sample is None:
        args.sample = 600 if args.device == "cuda" else 0
    if args.time_limit_s is None:
        args.time_limit_s = 480.0 if args.device == "cuda" else 0.0
    return args


def write_support_files(work):
    shim = work / "shim"
    shim.mkdir()
    files = dict(SHIMS)
    if find_spec("expecttest") is None:
        files["expecttest.py"] = EXPECTTEST_SHIM
    for name, text in files.items():
        (shim / name).write_text(text)
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")  # keeps the repository's pytest settings out
    return shim, ini, sorted(files)


def read_events(path, offset):
    """New complete JSON lines of an event log from byte offset on."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode("utf-8").splitlines()
    return [json.loads(ln) for ln in lines if ln.strip()], offset + end


class Run:
    """One mode (plain or patched): pytest processes until every chosen test has an outcome."""

    def __init__(self, mode, args, work, shim, ini):
        self.mode, self.args, self.work = mode, args, work
        self.shim, self.ini = shim, ini
        self.log = work / f"{mode}.jsonl"
        self.pytest_log = args.out / f"{mode}.log"
        self.records = {}
        self.processes = []  # (exit code, seconds) per pytest process
        self.fatal = None
        self.cut_by_time = False

    def command(self, selection):
        cmd = [sys.executable, "-m", "pytest", str(self.args.file), "-c", str(self.ini),
               "--rootdir", str(self.args.file.parent), "-p", "pytorch_sdpa_plugin",
               "-p", "no:cacheprovider", "-q", "--ows-log", str(self.log)] + selection
        return cmd + (["--ows-patch"] if self.mode == "patched" else [])

    def consume(self, offset, running):
        """Records the results logged since offset; returns the new offset and
        the test that started and has not finished (None if none)."""
        events, offset = read_events(self.log, offset)
        for ev in events:
            if ev["event"] == "start":
                running = ev["nodeid"]
            else:
                self.records[ev["nodeid"]] = ev
                running = None
        return offset, running

    def one_process(self, selection, deadline):
        """Runs pytest once; returns (exit code, nodeid left running or None, why)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.shim), str(Path(__file__).resolve().parent)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        offset = self.log.stat().st_size if self.log.exists() else 0
        running, started = None, time.monotonic()
        t0 = time.monotonic()
        with open(self.pytest_log, "a") as out:
            out.write(f"\n===== {' '.join(self.command(selection))}\n")
            out.flush()
            proc = subprocess.Popen(self.command(selection), cwd=self.args.file.parent,
                                    env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            why = None
            while True:
                try:
                    code = proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                before = running
                offset, running = self.consume(offset, running)
                now = time.monotonic()
                if running != before:
                    started = now
                if running and now - started > self.args.test_timeout_s:
                    why = "hung"
                elif deadline and now > deadline:
                    why = "time"
                if why:
                    os.killpg(proc.pid, signal.SIGKILL)
                    code = proc.wait()
                    break
        _, running = self.consume(offset, running)
        self.processes.append((code, round(time.monotonic() - t0, 1)))
        return code, running, why

    def execute(self, selection, ids_file, deadline):
        t0 = time.monotonic()
        code, running, why = self.one_process(selection, deadline)
        while True:
            if not ids_file.exists():
                self.fatal = f"pytest exited {code} before choosing tests: see {self.pytest_log}"
                break
            if not read_ids(ids_file):
                self.fatal = (f"no test chosen: no class matches {self.args.classes!r} "
                              f"on {self.args.device}")
                break
            if why == "time":
                self.cut_by_time = True
                break
            if running is None:  # pytest ended by itself
                if code not in (0, 1):
                    self.fatal = f"pytest exited {code}: see {self.pytest_log}"
                break
            # The process died (or was killed as hung) inside a test: record
            # it, then resume with the tests that have no outcome yet.
            self.records[running] = {"nodeid": running, "outcome": why or "crashed",
                                     "exc_type": why or f"exit status {code}", "message": ""}
            left = [i for i in read_ids(ids_file) if i not in self.records]
            if not left or len(self.processes) > MAX_RESUMES:
                break
            rest = self.work / f"{self.mode}.remaining.txt"
            rest.write_text("".join(f"{i}\n" for i in left))
            code, running, why = self.one_process(["--ows-ids", str(rest)], deadline)
        self.wall_s = round(time.monotonic() - t0, 1)

    def outcome(self, nodeid):
        rec = self.records.get(nodeid)
        return rec["outcome"] if rec else "not run"


def read_ids(path):
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]


def family_key(rec):
    return (rec.get("exc_type") or rec["outcome"], rec.get("message") or "")


def families(ids, run):
    groups = collections.defaultdict(list)
    for i in ids:
        groups[family_key(run.records[i])].append(i)
    return [{"exc_type": k[0], "message": k[1], "count": len(v), "ids": sorted(v),
             "detail": run.records[sorted(v)[0]].get("detail", "")}
            for k, v in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def environment(args):
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": args.device, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if args.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import openwam_sdpa
        info["openwam_sdpa"] = openwam_sdpa.build_info()
    except Exception as e:  # the report still says what PyTorch did
        info["openwam_sdpa"] = f"import failed: {type(e).__name__}: {e}"
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        info["source"] = head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        info["source"] = "unknown (no git)"
    data = args.file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    info["test_file"] = {"path": str(args.file), "sha256": digest,
                         "source": KNOWN_FILES.get(digest, "unknown (not a recorded version)")}
    return info


def build_report(args, env, shims, ids, runs):
    plain, patched = runs["plain"], runs["patched"]
    both_ran = [i for i in ids if plain.outcome(i) != "not run" and patched.outcome(i) != "not run"]
    patched_only = [i for i in both_ran if patched.outcome(i) in BAD and plain.outcome(i) not in BAD]
    plain_only = [i for i in both_ran if plain.outcome(i) in BAD and patched.outcome(i) not in BAD]
    return {
        "environment": env,
        "selection": {"classes": args.classes, "sample": args.sample, "seed": args.seed,
                      "chosen": len(ids), "compared": len(both_ran), "shims": shims},
        "runs": {m: {"counts": {o: sum(r.outcome(i) == o for i in ids) for o in OUTCOMES},
                     "wall_s": getattr(r, "wall_s", None), "processes": r.processes,
                     "cut_by_time_limit": r.cut_by_time, "fatal": r.fatal}
                 for m, r in runs.items()},
        "patched_only": families(patched_only, patched),
        "plain_only": families(plain_only, plain),
        # These hide whatever the patch changes in them: listed, as plain failed.
        "fail_in_both": families([i for i in both_ran if plain.outcome(i) in BAD
                                  and patched.outcome(i) in BAD], plain),
        "tests": {i: {"plain": plain.records.get(i), "patched": patched.records.get(i)} for i in ids},
    }


def markdown(rep):
    env, sel = rep["environment"], rep["selection"]
    out = ["# PyTorch's SDPA tests, plain vs openwam_sdpa.patch()", "",
           f"- test file: {env['test_file']['source']} (sha256 {env['test_file']['sha256'][:12]})",
           f"- torch {env['torch']}, Python {env['python']}, device {env['device']}"
           + (f" ({env['gpu']}, CUDA {env['cuda']}, cuDNN {env['cudnn']})" if env.get("gpu") else ""),
           f"- openwam_sdpa: {env['openwam_sdpa']}; source {env['source']}",
           f"- classes {sel['classes']}; sample {sel['sample'] or 'all'} (seed {sel['seed']}): "
           f"{sel['chosen']} tests chosen, {sel['compared']} ran in both runs",
           f"- stand-in modules: {', '.join(sel['shims'])}", "",
           "| run | " + " | ".join(OUTCOMES) + " | wall s |",
           "|---|" + "---|" * (len(OUTCOMES) + 1)]
    for mode, r in rep["runs"].items():
        out.append(f"| {mode} | " + " | ".join(str(r["counts"][o]) for o in OUTCOMES)
                   + f" | {r['wall_s']} |")
        if r["fatal"]:
            out.append(f"\n**{mode} run failed:** {r['fatal']}\n")
        elif r["cut_by_time_limit"]:
            out.append(f"\n**{mode} run stopped at --time-limit-s.**\n")
    n = sum(f["count"] for f in rep["patched_only"])
    out += ["", f"## Fail only when patched: {n} tests, {len(rep['patched_only'])} families", ""]
    for f in rep["patched_only"]:
        out += [f"### {f['count']} x `{f['exc_type']}`", "", f"> {f['message'] or '(no message)'}", ""]
        if f["detail"] and f["detail"] != f["message"]:
            out += ["First test's message:", "", "```", f["detail"], "```", ""]
        out += [f"- `{i}`" for i in f["ids"]] + [""]
    m = sum(f["count"] for f in rep["plain_only"])
    out += [f"## Fail only when plain: {m} tests", ""]
    for f in rep["plain_only"]:
        out += [f"- {f['count']} x `{f['exc_type']}`: {f['message']}"] + [f"  - `{i}`" for i in f["ids"]]
    k = sum(f["count"] for f in rep["fail_in_both"])
    out += ["", f"## Fail in both runs: {k} tests (as the plain run failed)", ""]
    for f in rep["fail_in_both"]:
        out += [f"- {f['count']} x `{f['exc_type']}`: {f['message']}"] + [f"  - `{i}`" for i in f["ids"]]
    return "\n".join(out) + "\n"


def main():
    args = parse_args()
    if not args.file.exists():
        print(f"pytorch_sdpa_tests: {args.file} is missing; see this script's docstring", file=sys.stderr)
        return 3
    args.file = args.file.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "report.md", "plain.log", "patched.log"):
        (args.out / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pytorch_sdpa_tests."))
    try:
        return compare(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(args, work):
    shim, ini, shims = write_support_files(work)
    ids_file = work / "ids.txt"
    t_end = time.monotonic() + args.time_limit_s if args.time_limit_s else None

    runs = {}
    suffix = "CUDA" if args.device == "cuda" else "CPU"
    choose = ["--ows-classes", args.classes, "--ows-device-suffix", suffix,
              "--ows-sample", str(args.sample), "--ows-seed", str(args.seed),
              "--ows-write-ids", str(ids_file)]
    for mode, selection in (("plain", choose), ("patched", ["--ows-ids", str(ids_file)])):
        run = Run(mode, args, work, shim, ini)
        runs[mode] = run
        # Each run may use what is left of the budget, the plain run half of it.
        deadline = None
        if t_end:
            now = time.monotonic()
            deadline = now + (t_end - now) / (2 if mode == "plain" else 1)
        print(f"[{mode}] running ...", flush=True)
        run.execute(selection, ids_file, deadline)
        if run.fatal:
            print(f"[{mode}] {run.fatal}", file=sys.stderr)
            break
    ids = read_ids(ids_file) if ids_file.exists() else []
    if "patched" not in runs:
        runs["patched"] = Run("patched", args, work, shim, ini)
        runs["patched"].fatal = "not started: the plain run failed"

    rep = build_report(args, environment(args), shims, ids, runs)
    (args.out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    (args.out / "report.md").write_text(markdown(rep))

    print(f"\n{len(ids)} tests chosen ({args.device}); test file: "
          f"{rep['environment']['test_file']['source']}")
    for mode, r in rep["runs"].items():
        c = r["counts"]
        print(f"  {mode:8s} " + ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o])
              + f"  ({r['wall_s']} s" + (", cut by --time-limit-s)" if r["cut_by_time_limit"] else ")"))
    n = sum(f["count"] for f in rep["patched_only"])
    print(f"fail only when patched: {n} tests in {len(rep['patched_only'])} families")
    for f in rep["patched_only"][:15]:
        print(f"  {f['count']:4d}  {f['exc_type']}: {f['message'][:110]}")
    m = sum(f["count"] for f in rep["plain_only"])
    k = sum(f["count"] for f in rep["fail_in_both"])
    print(f"fail only when plain: {m}; fail in both: {k}")
    print(f"report: {args.out / 'report.md'}")

    if any(r.fatal for r in runs.values()):
        return 3
    crashed = any(runs[m].outcome(i) in ("crashed", "hung") for m in runs for i in ids)
    return 2 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
