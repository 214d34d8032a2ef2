"""pytest plugin behind tools/pytorch_sdpa_tests.py (loaded with -p).

In the pytest process it: patches F.scaled_dot_product_attention with
openwam_sdpa before the test file is imported (so the file's own
`from torch.nn.functional import scaled_dot_product_attention` binds the
patched function too), picks the tests to run, and appends one JSON line per
test to an event log. A "start" line is flushed before each test, so the driver
can name the test that was running when the process died or hung.
"""

import fnmatch
import json
import random

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("openwam_sdpa", "openwam_sdpa drop-in check")
    group.addoption("--ows-patch", action="store_true",
                    help="apply openwam_sdpa.patch() before collection")
    group.addoption("--ows-log", help="append JSON lines (test start / result) here")
    group.addoption("--ows-ids", help="run exactly the test ids listed in this file")
    group.addoption("--ows-classes", default="*",
                    help="comma-separated test class names (globs) to choose from")
    group.addoption("--ows-device-suffix", default="CPU",
                    help="suffix of the instantiated classes (CPU, CUDA); "
                         "classes without it are never chosen")
    group.addoption("--ows-sample", type=int, default=0,
                    help="choose this many tests (0: all), stratified by test function")
    group.addoption("--ows-seed", type=int, default=0)
    group.addoption("--ows-write-ids", help="write the chosen test ids to this file")


def pytest_configure(config):
    if config.getoption("--ows-patch"):
        import openwam_sdpa
        openwam_sdpa.patch()
        assert openwam_sdpa.is_patched()
    log = config.getoption("--ows-log")
    if log:
        config.pluginmanager.register(_Recorder(log), "ows_recorder")


def _function_name(item):
    # instantiate_device_type_tests wraps each generated test with
    # functools.wraps, so __name__ is the test function as written in the file
    # (the node name adds the parameters and the device).
    return getattr(getattr(item, "obj", None), "__name__", item.name)


def stratified_sample(groups, n, seed):
    """n ids from {function: [ids]}, round-robin over the functions in sorted
    order after shuffling each function's ids with one seeded generator: every
    function is represented before any gets a second test."""
    rng = random.Random(seed)
    queues = []
    for name in sorted(groups):
        ids = sorted(groups[name])
        rng.shuffle(ids)
        queues.append(ids)
    chosen = []
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop())
    return sorted(chosen)


def pytest_collection_modifyitems(session, config, items):
    ids_file = config.getoption("--ows-ids")
    if ids_file:
        with open(ids_file, encoding="utf-8") as f:
            wanted = {line.strip() for line in f if line.strip()}
    else:
        patterns = [c for c in config.getoption("--ows-classes").split(",") if c]
        suffix = config.getoption("--ows-device-suffix")
        groups = {}
        for item in items:
            cls = item.cls.__name__ if item.cls is not None else ""
            base = cls[:-len(suffix)] if cls.endswith(suffix) else None
            if base and any(fnmatch.fnmatchcase(base, p) for p in patterns):
                groups.setdefault(f"{cls}.{_function_name(item)}", []).append(item.nodeid)
        every = sorted(i for ids in groups.values() for i in ids)
        n = config.getoption("--ows-sample")
        wanted = set(stratified_sample(groups, n, config.getoption("--ows-seed"))
                     if 0 < n < len(every) else every)
        out = config.getoption("--ows-write-ids")
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.writelines(f"{i}\n" for i in sorted(wanted))
    keep = [it for it in items if it.nodeid in wanted]
    drop = [it for it in items if it.nodeid not in wanted]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _exception(excinfo):
    value = excinfo.value
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    lines = []
    for ln in str(value).splitlines():
        if ln.startswith("To execute this test, run the following"):
            break  # PyTorch's repro hint, appended to every failure
        if ln.strip():
            lines.append(ln.strip())
    # The first line names the family; a few more show the specifics.
    return name, (lines[0] if lines else ""), "\n".join(lines[:6])[:1500]


class _Recorder:
    """One JSON line when a test starts, one with its outcome when it ends."""

    def __init__(self, path):
        self._log = open(path, "a", encoding="utf-8")
        self._tests = {}

    def _write(self, record):
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def pytest_unconfigure(self):
        self._log.close()

    def pytest_runtest_logstart(self, nodeid):
        self._tests[nodeid] = {"nodeid": nodeid, "outcome": "passed", "duration": 0.0}
        self._write({"event": "start", "nodeid": nodeid})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        result = yield
        report = result.get_result()
        rec = self._tests.get(item.nodeid)
        if rec is None or call.excinfo is None or report.passed:
            return
        if report.skipped:
            if rec["outcome"] == "passed":
                rec.update(outcome="skipped", message=str(call.excinfo.value).strip()[:300])
            return
        if rec["outcome"] in ("failed", "error"):
            return  # keep the first failure: a teardown error after it adds nothing
        exc_type, message, detail = _exception(call.excinfo)
        rec.update(outcome="failed" if call.when == "call" else "error",
                   when=call.when, exc_type=exc_type, message=message[:500], detail=detail)

    def pytest_runtest_logreport(self, report):
        rec = self._tests.get(report.nodeid)
        if rec is not None:
            rec["duration"] = round(rec["duration"] + report.duration, 3)

    def pytest_runtest_logfinish(self, nodeid):
        rec = self._tests.pop(nodeid, None)
        if rec is not None:
            self._write({"event": "result", **rec})
