"""Write the results: ``results.md`` (tables, goals, notes), ``results.json`` (every number) and PNG charts."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from scripts.bench.context import SuiteResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: Path, values: dict[str, float], xlabel: str, title: str,
              labels: dict[str, str] | None = None) -> Path:
    """Horizontal bars, one per contender, each labelled with its value and ``labels[name]`` (e.g. a ratio).

    Ratios go in as labels, computed by the suite (medians of same-round ratios), not from the bars.
    """
    plt = _plt()
    names = list(values)
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.4))
    bars = ax.barh(names, [values[n] for n in names], color="#4c72b0")
    for bar, name in zip(bars, names, strict=True):
        label = f"{values[name]:,.0f}" if values[name] >= 100 else f"{values[name]:.2f}"
        if labels and labels.get(name):
            label += f"  ({labels[name]})"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.set_xlim(0, max(values.values() or [1]) * 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def grouped_bars(path: Path, groups: dict[str, dict[str, float]], ylabel: str, title: str) -> Path:
    """Vertical bars: one group per contender, one bar per measured quantity (e.g. first step, exit)."""
    plt = _plt()
    names = list(groups)
    series = list(dict.fromkeys(k for g in groups.values() for k in g))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(names)), 4))
    for i, key in enumerate(series):
        xs = [j + i * width for j in range(len(names))]
        heights = [groups[n].get(key, 0) for n in names]
        bars = ax.bar(xs, heights, width, label=key)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mark(met: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[met]


def to_markdown(results: list[SuiteResult], header: dict) -> str:
    out = ["# Benchmark results", "",
           f"{header['date']} on {header['machine']}; torch {header['torch']}, lightning {header['lightning']}; "
           f"contenders on {header.get('accelerator', 'cpu')} ({header.get('device') or 'unknown'}), "
           f"precision {header.get('precision', '32-true')}; "
           f"command `{header['command']}`; load average before/after: {header['load_before']} / {header['load_after']}.",
           ""]
    goals = [(r.title, g) for r in results for g in r.goals]
    if goals:
        out += ["## Goals", "", markdown_table(["suite", "goal", "measured", "status"],
                                               [[t, g.text, g.measured, _mark(g.met)] for t, g in goals]), ""]
    for r in results:
        out += [f"## {r.title}", ""]
        if r.rows:
            out += [markdown_table(r.columns, r.rows), ""]
        if r.markdown:
            out += [r.markdown, ""]
        out += [f"- {n}" for n in r.notes]
        out += [f"\n![{p}]({p})" for p in r.plots]
        out.append("")
    return "\n".join(out)


def write(out: Path, results: list[SuiteResult], header: dict) -> dict[str, Path]:
    """Write ``results.md`` and ``results.json`` into ``out``; return their paths."""
    md = out / "results.md"
    md.write_text(to_markdown(results, header))
    js = out / "results.json"
    js.write_text(json.dumps({"header": header, "suites": [asdict(r) for r in results]}, indent=2, default=str))
    return {"markdown": md, "json": js}
