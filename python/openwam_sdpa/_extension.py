"""Loads the compiled extension and refuses a torch it was not built for.

A C++ extension is tied to the torch it was compiled against: against another
one it fails with an `undefined symbol` at import, or worse, loads and
misbehaves. Both cases end here in one clear error naming both versions.

Beyond that, only torch 2.11-2.15 is supported: the releases built and tested,
whose ATen cuDNN attention ops (`_scaled_dot_product_cudnn_attention` and its
backward, called directly) and `_fused_sdp_choice` have the schema the C++ code
is written for. Their CUDA wheels pin cuDNN 9.19-9.24 (2.11-2.14: the key-tail
defect this package fixes) and 9.26.0 (2.15: that defect fixed upstream; the
single-query-row defects cudnn-frontend #1071 and #1072 are reported on it and
stay guarded). Older releases were never checked: refused. A newer one was
never built: allowed, with a warning, so that a torch upgrade does not break a
program that still imports openwam_sdpa.
"""

import re
import warnings

import torch

# The first and last supported (major, minor) release.
SUPPORTED = ((2, 11), (2, 15))
# What was actually built and run, as opposed to checked by reading the schema.
TESTED = (
    "2.11.0+cu130: CPU and GPU suites on an H200 (cuDNN 9.19)",
    "2.12.0+cu130: CUDA build, CPU suite and C++ tests, no GPU run",
    "2.13.0+cpu: CPU suite and C++ tests",
    "2.14.1+cu130: CUDA build, CPU suite and C++ tests, no GPU run",
    "2.15.0+cu132: CUDA build, CPU suite and C++ tests, no GPU run",
)
# The newest cuDNN the guard table names (csrc/guards.h, kNewestKnownCudnn),
# as torch 2.15.0's CUDA wheels pin it (nvidia-cudnn-cu13==9.26.0.51).
NEWEST_KNOWN_CUDNN = "9.26"

_REBUILD = (
    "rebuild openwam_sdpa against the installed torch: "
    "pip install --no-build-isolation --force-reinstall --no-deps ."
)
_SUPPORT = (
    "openwam_sdpa supports torch {0[0]}.{0[1]}-{1[0]}.{1[1]} (the ATen cuDNN attention "
    "ops it calls were checked for these releases; built and tested: {2})"
).format(*SUPPORTED, "; ".join(TESTED))

try:
    from . import _C
except ImportError as exc:  # e.g. undefined symbol after a torch upgrade
    raise ImportError(
        f"openwam_sdpa: the compiled extension failed to load with torch "
        f"{torch.__version__} ({exc}); {_REBUILD}"
    ) from exc


def _release(version: str):
    """(major, minor) of a version string such as '2.14.1+cu130', or None."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_torch_version() -> None:
    built = _C.build_info()["torch_version"]
    installed = torch.__version__.split("+")[0]
    release = _release(installed)
    supported = release is not None and SUPPORTED[0] <= release <= SUPPORTED[1]
    if built != installed:
        raise ImportError(
            f"openwam_sdpa was built for torch {built}, but torch {installed} "
            f"is installed; "
            + (_REBUILD if supported else
               f"{_SUPPORT}. Install one of those, then {_REBUILD}")
        )
    if release is None or release < SUPPORTED[0]:
        raise ImportError(
            f"openwam_sdpa does not support torch {installed}: {_SUPPORT}"
        )
    if release > SUPPORTED[1]:
        warnings.warn(
            f"openwam_sdpa: torch {installed} is newer than the releases it was "
            f"built and checked against; {_SUPPORT}. Its guard table names cuDNN "
            f"up to {NEWEST_KNOWN_CUDNN} (torch {SUPPORTED[1][0]}.{SUPPORTED[1][1]}); "
            "on a newer cuDNN only the rows of defects with no known fix apply (no "
            "key-tail fix); the rest of openwam_sdpa is unverified on this torch.",
            stacklevel=2,
        )


_check_torch_version()
