"""Benchmark plots, drawn with matplotlib's Agg canvas (no display, no global pyplot state)."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def plot_tokens_per_s(tokens_per_s: Mapping[str, float], path: str | os.PathLike[str]) -> None:
    """Bar chart of mean per-question tokens/s, one bar per method."""
    fig, ax = _figure()
    names = list(tokens_per_s)
    bars = ax.bar(names, [tokens_per_s[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("tokens / s")
    ax.set_title("Decoding speed")
    fig.savefig(path, dpi=120)


def plot_accept_lengths(
    accept_lengths: Mapping[str, Sequence[int]], path: str | os.PathLike[str]
) -> None:
    """Histogram (fraction of target steps) of accept lengths, one step outline per method."""
    fig, ax = _figure()
    top = max(max(lengths) for lengths in accept_lengths.values())
    bins = np.arange(1, top + 2) - 0.5
    for name, lengths in accept_lengths.items():
        weights = np.full(len(lengths), 1.0 / len(lengths))
        ax.hist(lengths, bins=bins, weights=weights, histtype="step", linewidth=1.5, label=name)
    ax.set_xticks(np.arange(1, top + 1))
    ax.set_xlabel("tokens emitted per target step")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accept lengths")
    ax.legend()
    fig.savefig(path, dpi=120)


def plot_speedup_vs_gamma(
    points: Sequence[tuple[str, int, float]], path: str | os.PathLike[str]
) -> None:
    """Speedup against draft length gamma; `points` are (method, gamma, speedup)."""
    fig, ax = _figure()
    ordered = sorted(points, key=lambda p: p[1])
    gammas = [g for _, g, _ in ordered]
    speedups = [s for _, _, s in ordered]
    ax.plot(gammas, speedups, marker="o")
    for name, gamma, speedup in ordered:
        ax.annotate(name, (gamma, speedup), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.margins(x=0.1)
    ax.set_xticks(sorted(set(gammas)))
    ax.set_xlabel("gamma (draft tokens per step)")
    ax.set_ylabel("speedup over baseline")
    ax.set_title("Speedup vs gamma")
    fig.savefig(path, dpi=120)
