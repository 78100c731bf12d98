"""Layer x head heatmaps, one panel per kind: the gates during training (heads, FFN units, layers), the head
report's measures. A feed-forward panel is layer x unit (hundreds or thousands of units: a fixed width, each
layer's kept count beside its label instead of a cross per unit); a layer panel is one column, a gate per layer."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from gatedprune.structures.head_gates import HeadGates  # noqa: E402
from gatedprune.structures.kinds import KINDS  # noqa: E402
from gatedprune.utils import atomic_write_bytes  # noqa: E402

# {kind: [(layer, one value per head, None or nan where the layer has no such head), ...]}
Panels = Mapping[str, Sequence[tuple[int, Sequence[float | None]]]]
MISSING_COLOUR = "0.82"  # heads a layer does not have (pruned away, or fewer than the widest layer): light grey
UNITS_WIDTH = 12  # cells' worth of width of a feed-forward panel, whatever its units (a head panel: one per head)
LAYER_WIDTH = 3  # of a layer panel (one column), so that its title and colour stay readable
AXIS_LABELS = {"heads": "head", "units": "unit", "layer": ""}


def _structure(kind: str) -> str:
    """"heads", "units" or "layer"; a panel not named by a kind (a caller's own) is one of heads."""
    return KINDS[kind].structure if kind in KINDS else "heads"


def _width(kind: str, grid: np.ndarray) -> float:
    """How wide the panel of ``grid`` is drawn, in cells."""
    structure = _structure(kind)
    return float(grid.shape[1]) if structure == "heads" else float(UNITS_WIDTH if structure == "units" else LAYER_WIDTH)


def _grid(rows: Sequence[tuple[int, Sequence[float | None]]]) -> np.ndarray:
    """The rows of one panel padded with nan to its widest layer.  # (L, H)"""
    width = max((len(values) for _, values in rows), default=0)
    grid = np.full((len(rows), max(width, 1)), np.nan)
    for i, (_, values) in enumerate(rows):
        grid[i, : len(values)] = [np.nan if v is None else float(v) for v in values]
    return grid


def head_heatmap(panels: Panels, *, label: str, title: str | None = None, vmin: float | None = None,
                 vmax: float | None = None, cmap: str = "viridis", marks: Panels | None = None,
                 panel_titles: Mapping[str, str] | None = None) -> Figure:
    """A figure of one value per structure: a panel per kind (layer down; heads, units or the layer's one gate
    across), one colour bar for all.

    Heads a layer does not have are grey; ``marks`` (same shape, truthy values) are crossed out, except in a
    feed-forward panel, whose layer labels say how many units are not marked. ``vmin``/``vmax`` default to the range
    of the values. Constrained layout keeps the title, panel titles, tick labels, axis labels and colour bar clear of
    each other whatever the number of layers, heads and units.
    """
    grids = {kind: _grid(rows) for kind, rows in panels.items() if rows}
    if not grids:
        raise ValueError("a heatmap needs at least one panel with one layer")
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()])
    low = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    high = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    if not high > low:
        high = low + 1.0
    colours = plt.get_cmap(cmap).with_extremes(bad=MISSING_COLOUR)
    widths = [_width(kind, g) for kind, g in grids.items()]
    layers = max(g.shape[0] for g in grids.values())
    # cells of about `cell` inches in every panel: panel widths follow their head counts, and each panel adds room
    # for its layer labels; the colour bar and the titles get their own room
    cell = 0.4
    rooms = [1.3 if _structure(kind) == "units" else 0.8 for kind in grids]  # units: "layer (kept/units)" labels
    across = min(cell, 12.0 / sum(widths))  # many heads: narrower cells, so the figure stays about a page wide
    lines = len(title.splitlines()) if title else 0
    fig = plt.figure(
        figsize=(max(4.5, sum(across * w + room for w, room in zip(widths, rooms)) + 1.2),
                 cell * layers + 1.3 + 0.2 * lines),
        layout="constrained",
    )
    axes = fig.subplots(1, len(grids), squeeze=False, width_ratios=widths)[0]
    image = None
    for ax, (kind, grid) in zip(axes, grids.items()):
        rows, structure = panels[kind], _structure(kind)
        image = ax.imshow(np.ma.masked_invalid(grid), vmin=low, vmax=high, cmap=colours, aspect="auto",
                          interpolation="nearest")
        labels = [str(layer) for layer, _ in rows]
        crossed = np.nan_to_num(_grid(marks[kind])) > 0 if marks and marks.get(kind) else None
        if crossed is not None and structure == "units":  # a cross per unit would blot out the panel: counts
            labels = [f"{layer} ({int(np.isfinite(g).sum() - c.sum())}/{int(np.isfinite(g).sum())})"
                      for (layer, _), g, c in zip(rows, grid, crossed)]
        elif crossed is not None:
            ys, xs = np.nonzero(crossed)
            ax.scatter(xs, ys, marker="x", color="red", s=30, linewidths=1.2)
        ax.set_title((panel_titles or {}).get(kind, kind), fontsize=9)
        ax.set_xlabel(AXIS_LABELS[structure])
        ax.set_ylabel("layer")
        if structure == "layer":
            ax.set_xticks([])
        else:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=min(grid.shape[1], 16 if structure == "heads" else 6),
                                                   integer=True))
        ax.set_yticks(range(len(rows)), labels)
        ax.tick_params(labelsize=8)
    fig.colorbar(image, ax=list(axes), label=label, aspect=max(5, 4 * layers), fraction=0.05)
    if title:  # wrapped to the figure's width (about 12 characters per inch at this size), so none is cut off
        width = fig.get_size_inches()[0]
        fig.suptitle("\n".join(textwrap.fill(line, int(12 * width)) for line in title.splitlines()), fontsize=10)
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG at ``path`` (through a temporary file: never half a picture) and close it."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


@torch.no_grad()
def save_gate_heatmap(gates: HeadGates, path: Path, step: int | None = None) -> Path:
    """Save P(open) per gate as a heatmap, a panel per gated kind; what the binary rule removes is crossed out (FFN
    units: counted beside each layer). A gate of ``ffn_group`` units is drawn once per unit."""
    def per_unit(values: list, size: int) -> list:
        return [v for v in values for _ in range(size)]

    p_open = gates.by_kind([per_unit(g.p_open().cpu().tolist(), n) for g, n in zip(gates.gates, gates.group_sizes)])
    closed = gates.by_kind([per_unit((g.binary() == 0).cpu().tolist(), n)
                            for g, n in zip(gates.gates, gates.group_sizes)])
    titles = {kind: f"{kind}\n{sum(not c for _, row in closed[kind] for c in row)}/"
                    f"{sum(len(row) for _, row in closed[kind])} kept" for kind in closed}
    fig = head_heatmap(p_open, label="P(open)", vmin=0, vmax=1, marks=closed, panel_titles=titles,
                       title=None if step is None else f"gates at step {step} (x: removed by log_alpha <= 0)")
    return save_figure(fig, path)


def symmetric_range(values: Sequence[float | None]) -> tuple[float, float]:
    """(-m, m) for the largest |value| m: a diverging colour map then puts 0 in its middle."""
    m = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=0.0)
    return (-m, m) if m > 0 else (-1.0, 1.0)
