"""`python -m openwam_sdpa doctor [--json]`: diagnose this stack (see doctor.py)."""

import sys

from . import doctor

USAGE = "usage: python -m openwam_sdpa doctor [--json]"


def main(argv):
    if not argv or argv[0] != "doctor":
        print(USAGE, file=sys.stderr)
        return 64
    return doctor.main(argv[1:])


sys.exit(main(sys.argv[1:]))
