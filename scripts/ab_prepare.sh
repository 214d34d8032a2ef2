#!/usr/bin/env bash
# The sources of a git revision beside the working tree, for a same-machine
# A/B of the repair kernel on the device (device_run.sh's `ab` part):
#
#   bash scripts/ab_prepare.sh [REV]          # default HEAD
#   then run `bash scripts/device_run.sh ab` with carry ["build/ab_base"]
#
# Why: kernel changes of a few percent are smaller than the spread between
# two device machines (3-5% on the same code, 2026-12-01 runs F1-F6); the
# `ab` part builds both on one machine and alternates them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REV=${1:-HEAD}
DEST=build/ab_base
rm -rf "$DEST"
mkdir -p "$DEST"
git archive "$REV" -- csrc python setup.py pyproject.toml CMakeLists.txt README.md \
  benchmarks ':(exclude)benchmarks/results' | tar -x -C "$DEST"
git rev-parse --short "$REV" >"$DEST/REVISION"
echo "$DEST: $(cat "$DEST/REVISION") ($(du -sh "$DEST" | cut -f1)); carry it to the device: [\"$DEST\"]"
