"""Writing results (shared by every benchmark here): number formats, markdown
tables, the PNG helper and the json/md/png files under --out."""

from __future__ import annotations

import json
from pathlib import Path

DASH = "—"


def ratio(a, b):
    """a / b, None when either is missing (0 / 0 is 1)."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def num(x, spec="{:.3f}"):
    """A number for a table cell; — when missing."""
    return DASH if x is None else spec.format(x)


def spread(r, spec="{:.3f}", lo_hi="{:.2f}"):
    """An over_rounds() dict as 'median [min–max]'."""
    if not r:
        return DASH
    return f"{spec.format(r['median'])} [{lo_hi.format(r['min'])}–{lo_hi.format(r['max'])}]"


def md_table(head, rows):
    """A markdown table: head is a list of column titles, rows lists of cell strings."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (the PNG is then skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: {e}")
        return None
    return plt


def log_ratio_axis(ax, label):
    """A log y axis with plain ratio ticks and a line at 1."""
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ticks = [0.5, 0.75, 1, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 16, 32, 64, 128]
    lo, hi = ax.get_ylim()
    shown = [t for t in ticks if lo <= t <= hi]
    ax.set_yticks(shown, [f"{t:g}" for t in shown])
    ax.minorticks_off()
    ax.set_ylabel(label)


def save_figure(fig, path):
    """Writes the figure as a PNG and frees it; True (a plot function's answer)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def stack_title(stack):
    return f"{stack['gpu']}, torch {stack['torch']}, cuDNN {stack['cudnn']}, {stack['date'][:10]}"


def write_json(result, out_dir, stem):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))


def write_outputs(result, out_dir, stem, markdown, plots=()):
    """<stem>.json, <stem>.md and one <stem><suffix>.png per (suffix, plot(result, path)) under
    out_dir; returns the names of the files written (a plot returns False when it has nothing)."""
    out_dir = Path(out_dir)
    write_json(result, out_dir, stem)
    (out_dir / f"{stem}.md").write_text(markdown)
    written = [f"{stem}.json", f"{stem}.md"]
    for suffix, plot in plots:
        try:
            if plot(result, out_dir / f"{stem}{suffix}.png"):
                written.append(f"{stem}{suffix}.png")
        except Exception as e:  # noqa: BLE001 - a broken plot must not cost the tables of a GPU run
            print(f"plot {stem}{suffix}.png failed: {type(e).__name__}: {e}")
    return written
