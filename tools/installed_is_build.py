"""Whether an installed openwam_sdpa is this checkout's build, for tools/test.sh:

    python tools/installed_is_build.py INSTALLED SOURCE BUILT

exits 0 when the package directory INSTALLED holds the same .py files as
SOURCE (python/openwam_sdpa), byte for byte and no others, and the same
extension (_C*.so) as BUILT (setup.py build_ext's output for this checkout),
byte for byte; 1 otherwise. A rebuild from unchanged objects links the same
bytes, so an install from these sources passes and one from any other fails.
"""

import filecmp
import sys
from pathlib import Path


def files(folder, pattern):
    return {p.relative_to(folder) for p in folder.rglob(pattern) if "__pycache__" not in p.parts}


def same_files(a, b, pattern):
    names = files(b, pattern)
    return bool(names) and files(a, pattern) == names and all(
        filecmp.cmp(a / name, b / name, shallow=False) for name in names)


def main(argv):
    installed, source, built = map(Path, argv)
    return 0 if same_files(installed, source, "*.py") and same_files(installed, built, "_C*.so") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
