"""The report writer of every benchmark here: number formats, markdown tables, the
json and md files under --out, and what a --selftest reads back from them.
(The PNGs for the docs are plot.py's.)"""

from __future__ import annotations

import json
from pathlib import Path

from timing import percentile

DASH = "—"


def num(x, spec="{:.3f}"):
    """A number for a table cell; — when missing."""
    return DASH if x is None else spec.format(x)


def spread(r, spec="{:.3f}", lo_hi=None):
    """An over_rounds() dict as 'median [min–max]', all three at `spec`'s
    precision unless `lo_hi` says otherwise (with fewer digits for the range,
    a median of 0.998 printed beside [1.00–1.00])."""
    lo_hi = spec if lo_hi is None else lo_hi
    if not r:
        return DASH
    return f"{spec.format(r['median'])} [{lo_hi.format(r['min'])}–{lo_hi.format(r['max'])}]"


def md_table(head, rows):
    """A markdown table: head is a list of column titles, rows lists of cell strings."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stack_title(stack):
    return f"{stack['gpu']}, torch {stack['torch']}, cuDNN {stack['cudnn']}, {stack['date'][:10]}"


def write_json(result, out_dir, stem):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))


def write_outputs(result, out_dir, stem, markdown):
    """<stem>.json and <stem>.md under out_dir; returns the names of the files written."""
    write_json(result, out_dir, stem)
    (Path(out_dir) / f"{stem}.md").write_text(markdown)
    return [f"{stem}.json", f"{stem}.md"]


# ------------------------------------------------------------ read back by the selftests


def table_rows(md, title):
    """The body rows of the first markdown table after the line that starts with `title`."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows, seen_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen_table = True
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif seen_table:
            break
    assert rows, f"no table after {title!r}"
    return rows[2:]  # past the head and the |---| line


def check_round_ratio(runs, ratios, name, base, key):
    """A stored paired ratio is the median [min, max] of the per-round ratios of the raw times."""
    per_round = [a / b for a, b in zip(runs[name][key], runs[base][key])]
    assert abs(ratios["median"] - percentile(per_round, 50)) < 1e-12, (name, key)
    assert ratios["min"] == min(per_round) and ratios["max"] == max(per_round), (name, key)
