"""The report's charts as PNG data URIs, drawn with matplotlib's Agg renderer on Figure objects (no pyplot, no
display, no global backend switch). Long runs are thinned to at most MAX_POINTS points per line and MAX_COLUMNS
heatmap columns (block means), so a page stays small whatever the number of steps.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

MAX_POINTS = 2000
MAX_COLUMNS = 400
DPI = 100
WIDTH, HEIGHT = 8.0, 3.2
"""Inches of a standard chart (800 x 320 pixels)."""


@dataclass(frozen=True)
class Image:
    uri: str
    """data:image/png;base64,..."""
    width: int
    height: int


@dataclass
class Line:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: dict = field(default_factory=dict)
    """Extra keyword arguments of Axes.plot (linestyle, color ...)."""


@dataclass(frozen=True)
class VMark:
    """A vertical marker on a step axis: where a run resumed or restarted."""

    x: float
    label: str


def human_bytes(n: float, _pos=None) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


BYTES = FuncFormatter(human_bytes)


def _image(fig: Figure) -> Image:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    width, height = (round(v * DPI) for v in fig.get_size_inches())
    return Image("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), width, height)


def thin(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS) -> tuple[list, list]:
    """Every k-th point (and the last) so that at most about `limit` remain."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    k = math.ceil(len(xs) / limit)
    idx = list(range(0, len(xs), k))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _marks(ax, marks: Sequence[VMark], colour: str = "#666666") -> None:
    for m in marks:
        ax.axvline(m.x, color=colour, linestyle="--", linewidth=1)
        ax.annotate(m.label, (m.x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", fontsize=7, color=colour, va="top", rotation=90)


def line_chart(title: str, lines: Sequence[Line], ylabel: str = "", xlabel: str = "step",
               marks: Sequence[VMark] = (), log_y: bool = False, byte_axis: bool = False,
               height: float = HEIGHT) -> Image:
    """One axis of lines over a step axis, with the run's resume/restart markers."""
    fig = Figure(figsize=(WIDTH, height))
    ax = fig.add_subplot()
    for line in lines:
        xs, ys = thin(line.xs, line.ys)
        style = {"linewidth": 1.4, "marker": "o" if len(xs) < 30 else None, "markersize": 3, **line.style}
        ax.plot(xs, ys, label=line.label, **style)
    if log_y and all(y > 0 for line in lines for y in line.ys if math.isfinite(y)):
        ax.set_yscale("log")
    if byte_axis:
        ax.yaxis.set_major_formatter(BYTES)
    _marks(ax, marks)
    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return _image(fig)


def _block_means(matrix: list[list[float]], steps: list[int]) -> tuple[list[list[float]], list[int]]:
    """Columns averaged in blocks so that at most MAX_COLUMNS remain; each block keeps its first step."""
    if len(steps) <= MAX_COLUMNS:
        return matrix, steps
    k = math.ceil(len(steps) / MAX_COLUMNS)
    cols = range(0, len(steps), k)
    return [[sum(row[c:c + k]) / len(row[c:c + k]) for c in cols] for row in matrix], [steps[c] for c in cols]


def load_heatmap(title: str, matrix: list[list[float]], steps: list[int], marks: Sequence[VMark] = (),
                 dropped: Line | None = None) -> Image:
    """Expert load of one MoE layer: experts (rows) x steps (columns), colour = share of the routed assignments;
    with `dropped`, a strip below with the share of assignments capacity dropped."""
    matrix, steps = _block_means(matrix, steps)
    experts = len(matrix)
    fig = Figure(figsize=(WIDTH, 2.4 + min(experts, 64) * 0.06 + (1.2 if dropped else 0)))
    grid = fig.add_gridspec(2 if dropped else 1, 2, width_ratios=[50, 1], wspace=0.03, hspace=0.12,
                            height_ratios=[3, 1] if dropped else [1])
    top, colour_axis = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
    extent = (steps[0] - half, steps[-1] + half, experts - 0.5, -0.5)
    shown = top.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent, vmin=0)
    fig.colorbar(shown, cax=colour_axis, label="share routed")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("expert")
    top.set_title(title, fontsize=11)
    _marks(top, marks, "white")
    bottom = top
    if dropped:
        bottom = fig.add_subplot(grid[1, 0], sharex=top)
        top.tick_params(labelbottom=False)
        xs, ys = thin(dropped.xs, dropped.ys)
        bottom.plot(xs, ys, color="#d62728", linewidth=1.2, marker="o" if len(xs) < 30 else None, markersize=3)
        bottom.set_ylabel("dropped", fontsize=8)
        bottom.set_ylim(bottom=0)
        bottom.grid(True, alpha=0.3)
    bottom.set_xlabel("step")
    height = fig.get_size_inches()[1]
    fig.subplots_adjust(left=0.08, right=0.9, top=1 - 0.35 / height, bottom=0.55 / height)  # inches of margin
    return _image(fig)


def grouped_bars(title: str, groups: Sequence[str], bars: dict[str, Sequence[float]], ylabel: str = "",
                 byte_axis: bool = False) -> Image:
    """Bars side by side per group (e.g. per rank: measured and planned bytes)."""
    fig = Figure(figsize=(WIDTH, HEIGHT))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(bars))
    for i, (label, values) in enumerate(bars.items()):
        ax.bar([g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))
    if byte_axis:
        ax.yaxis.set_major_formatter(BYTES)
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if len(bars) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _image(fig)


def categories_strip(title: str, values: Sequence[str], xlabel: str = "MoE layer") -> Image:
    """One coloured cell per position (e.g. each MoE layer's placement), its category written in it."""
    names = sorted(set(values), key=list(values).index)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    colour = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    fig = Figure(figsize=(WIDTH, 1.6))
    ax = fig.add_subplot()
    for i, value in enumerate(values):
        ax.broken_barh([(i - 0.45, 0.9)], (0, 1), facecolors=colour[value])
        if len(values) <= 32:
            ax.text(i, 0.5, value, ha="center", va="center", fontsize=8, color="white",
                    rotation=0 if len(values) <= 12 else 90)
    ax.set_xlim(-0.6, len(values) - 0.4)
    ax.set_yticks([])
    ax.set_xticks(range(len(values)) if len(values) <= 32 else [])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return _image(fig)


def timeline(title: str, spans: dict[str, Sequence[Sequence[float]]]) -> Image:
    """One row per kind (compute, copy, wait) with its spans, times in milliseconds."""
    colours = {"compute": "#2ca02c", "copy": "#1f77b4", "wait": "#d62728"}
    kinds = [k for k in ("compute", "copy", "wait") if k in spans] + [k for k in spans if k not in colours]
    fig = Figure(figsize=(WIDTH, 0.9 + 0.5 * len(kinds)))
    ax = fig.add_subplot()
    for row, kind in enumerate(kinds):
        bars = [(s * 1e3, max((e - s) * 1e3, 1e-3)) for s, e in spans[kind]]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colours.get(kind, "#7f7f7f"))
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.6, len(kinds) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the token's forward")
    ax.set_title(title, fontsize=11)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return _image(fig)
