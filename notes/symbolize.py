# Symbolize the frames printed by notes/segv_backtrace.c (lib(+0xoff) or
# lib(sym+0xoff)) with addr2line -f -C, on the machine that ran them.
#   python3 notes/symbolize.py < crash.log
import re
import subprocess
import sys

for line in sys.stdin:
    line = line.rstrip("\n")
    m = re.match(r"^(/\S+?)\(([^)+]*)\+(0x[0-9a-f]+)\)\[", line)
    if not m:
        print(line)
        continue
    lib, sym, off = m.groups()
    if sym:
        name = subprocess.run(["c++filt", sym], capture_output=True, text=True).stdout.strip()
        print(f"{lib.rsplit('/', 1)[-1]}: {name} +{off}")
        continue
    r = subprocess.run(["addr2line", "-f", "-C", "-e", lib, off], capture_output=True, text=True)
    fn, _, where = r.stdout.partition("\n")
    print(f"{lib.rsplit('/', 1)[-1]} {off}: {fn} {where.strip()}")
