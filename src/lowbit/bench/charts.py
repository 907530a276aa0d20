"""PNG charts of benchmark rows: one baseline per chart, one panel per shape, horizontal bars.

Each bar is a ratio against the chart's single baseline (drawn as the line at 1), so a peer that
is 50x slower does not flatten the rest: the axis turns logarithmic when the ratios span more
than 10x. Timings taken on the CPU carry ``CPU_NOTE`` (chart footnote, table title): there
lowbit runs its reference kernels, so the bars say nothing about its speed on a GPU.
"""

from __future__ import annotations

import os
from typing import Sequence

PEER_COLOR, LOWBIT_COLOR = "#9a9a9a", "#3f6fb0"
CPU_TAG = "lowbit on its CPU reference kernels, not timed for speed"
CPU_NOTE = (
    "CPU: lowbit runs its C++ reference kernels (written to be exact, not fast) next to XLA's "
    "optimized CPU code; lowbit's speed is measured on a GPU"
)


def backend_note(platform: str) -> str | None:
    """The caveat a reader needs for timings taken on ``platform`` (None on a GPU)."""
    return CPU_NOTE if platform == "cpu" else None


def ratio_chart(
    path: str,
    rows: Sequence[dict],
    title: str,
    xlabel: str,
    value: str = "speedup",
    group: str = "model",
    label: str = "name",
    note: str | None = None,
) -> str | None:
    """Bars of ``row[value]`` labelled ``row[label]``, one panel per distinct ``row[group]``, with
    ``note`` as a footnote under them. Returns the path, or None when matplotlib is missing or
    there is nothing to draw."""
    rows = [r for r in rows if isinstance(r.get(value), (int, float))]
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = list(dict.fromkeys(r[group] for r in rows))
    per = [[r for r in rows if r[group] == g] for g in groups]
    heights = [0.32 * len(p) + 0.7 for p in per]
    foot = 0.45 if note else 0.0  # inches kept free for the footnote
    total = sum(heights) + 0.8 + foot
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(9, total), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    values = [r[value] for r in rows]
    log = max(values) / max(min(values), 1e-9) > 10
    for ax, g, part in zip(axes[:, 0], groups, per):
        ys = range(len(part))[::-1]
        vals = [r[value] for r in part]
        colors = [LOWBIT_COLOR if "lowbit" in str(r[label]) else PEER_COLOR for r in part]
        ax.barh(list(ys), vals, color=colors, height=0.7)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([str(r[label]) for r in part], fontsize=8)
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f}x" if v < 10 else f" {v:.0f}x", va="center", fontsize=7)
        if log:
            ax.set_xscale("log")
        ax.set_xlim(right=max(values) * (3 if log else 1.18))
        ax.set_title(str(g), fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title, fontsize=10)
    if note:
        fig.text(0.01, 0.1 / total, note, fontsize=7, ha="left", va="bottom", wrap=True, color="#a03000")
    fig.tight_layout(rect=(0, foot / total, 1, 1 - 0.35 / total))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
