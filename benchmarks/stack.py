"""The software under test: importing openwam_sdpa, switching its settings, and
recording the stack a run ran on (shared by every benchmark here)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# Every setting a contender runs under, so that openwam_settings() clears what
# the shell set (OPENWAM_SDPA_UNPAD too: inherited, it made "padded" runs
# padding-free in the transformers integration).
SETTINGS = ("OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD", "OPENWAM_SDPA_CHECK_FINITE",
            "OPENWAM_SDPA_FRONTEND", "OPENWAM_SDPA_VARLEN", "OPENWAM_SDPA_UNPAD")


def require_device(selftest: bool) -> None:
    """A benchmark needs CUDA, except its --selftest, which runs tiny shapes on
    one CPU thread (threads would only contend with the machine's other work)."""
    if not torch.cuda.is_available() and not selftest:
        raise SystemExit("no CUDA device; use --selftest to check the benchmark on the CPU")
    if selftest:
        torch.set_num_threads(1)


def import_openwam():
    """Import openwam_sdpa (falling back to <repo>/python on sys.path); returns (module, error)."""
    try:
        import openwam_sdpa
        return openwam_sdpa, None
    except Exception as first:  # noqa: BLE001 - report any import failure
        sys.path.insert(0, str(REPO / "python"))
        try:
            import openwam_sdpa
            return openwam_sdpa, None
        except Exception:  # noqa: BLE001
            return None, f"{type(first).__name__}: {first}"


def set_env(values):
    """os.environ[k] = v for each item (v None removes k), then has openwam_sdpa re-read its
    settings: it reads them once, at import, and caches them."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    ow = sys.modules.get("openwam_sdpa")
    if ow is not None and hasattr(ow, "reload_settings"):
        ow.reload_settings()
        ow.varlen_settings(reload=True)


@contextlib.contextmanager
def openwam_settings(**values):
    """OPENWAM_SDPA_<NAME>=value for the block (None: unset), then the previous values.

    openwam_settings() with no argument is openwam_sdpa as shipped: every
    OPENWAM_SDPA_* variable unset."""
    values = {**{k: None for k in SETTINGS}, **{f"OPENWAM_SDPA_{k}": v for k, v in values.items()}}
    old = {k: os.environ.get(k) for k in values}
    set_env(values)
    try:
        yield
    finally:
        set_env(old)


def git_rev():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def stack_info(ow, ow_error, settings):
    """Versions, GPU, date, commit and the run's settings, for the head of every result."""
    cuda = torch.cuda.is_available()
    tf = sys.modules.get("transformers")
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "python": platform.python_version(),
        "transformers": getattr(tf, "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_rev(),
        "openwam_sdpa": getattr(ow, "__version__", None) if ow else None,
        "openwam_sdpa_file": getattr(ow, "__file__", None) if ow else None,
        "openwam_import_error": ow_error,
        "openwam_settings": ow.settings() if ow is not None and hasattr(ow, "settings") else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith("OPENWAM_")},
        "settings": settings,
    }


def headline(stack):
    """One line naming the stack, printed first by every benchmark."""
    ow = stack["openwam_sdpa_file"] or f"NOT IMPORTED: {stack['openwam_import_error']}"
    return f"{stack['gpu']} torch {stack['torch']} cuDNN {stack['cudnn']} openwam_sdpa {ow}"
