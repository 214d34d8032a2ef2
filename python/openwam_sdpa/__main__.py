"""`python -m openwam_sdpa COMMAND`: the command line (cli.py)."""

import signal
import sys

from .cli import main

if hasattr(signal, "SIGPIPE"):
    # `... | head` ends the output quietly, as for other command-line tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
sys.exit(main())
