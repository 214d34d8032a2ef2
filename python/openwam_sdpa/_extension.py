"""Loads the compiled extension and refuses a torch it was not built for.

A C++ extension is tied to the torch it was compiled against: against another
one it fails with an `undefined symbol` at import, or worse, loads and
misbehaves. Both cases end here in one clear error naming both versions.
"""

import torch

_REBUILD = (
    "rebuild openwam_sdpa against the installed torch: "
    "pip install --no-build-isolation --force-reinstall --no-deps ."
)

try:
    from . import _C
except ImportError as exc:  # e.g. undefined symbol after a torch upgrade
    raise ImportError(
        f"openwam_sdpa: the compiled extension failed to load with torch "
        f"{torch.__version__} ({exc}); {_REBUILD}"
    ) from exc


def _check_torch_version() -> None:
    built = _C.build_info()["torch_version"]
    installed = torch.__version__.split("+")[0]
    if built != installed:
        raise ImportError(
            f"openwam_sdpa was built for torch {built}, but torch {installed} "
            f"is installed; {_REBUILD}"
        )


_check_torch_version()
