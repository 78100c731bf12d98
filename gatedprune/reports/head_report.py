"""The head report's files: ``heads.csv``, ``heads.md`` and the layer x head heatmaps of ``analysis.analyze``.

Layers are numbered as in the unpruned model throughout (an export whose layers were dropped included); a dropped
layer is a grey row of the heatmaps, and ``heads.md`` says which layers and how many FFN units went."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from gatedprune.reports.analysis import COLUMNS, POSITIONS, QUERY_TOKENS, Report


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def heads_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows([[_cell(row[c]) for c in COLUMNS] for row in report.rows])
    return buffer.getvalue()


def heads_markdown(report: Report) -> str:
    from gatedprune.utils import markdown_table

    about, rows = report.about, report.rows
    shown = [c for c in COLUMNS if c != "path" and any(row[c] is not None for row in rows)]

    def short(value) -> str:
        return "" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = [
        "# Head report", "",
        f"{about['subject']}; {about['pairs']} pairs of the {about['split']} split ({about['data']}), "
        f"{about['target_tokens']} target tokens, teacher-forced loss {about['loss']:.4f} nats per token.", "",
    ]
    removed = _removed_line(about.get("removed"))
    if removed:
        lines += [removed, ""]
    positional = [r for r in rows if any((r[p] or 0) >= 0.9 for p in POSITIONS)]
    if positional:  # Voita et al.: a positional head points at one relative position at least 90% of the time
        lines += ["Positional heads (>= 90% of query tokens to one neighbour): " + ", ".join(
            f"{r['kind']} {r['layer']}.{r['head']} ({max(POSITIONS, key=lambda p: r[p] or 0)})" for r in positional) + "."]
    needed = sorted(rows, key=lambda r: -r["ablation"])[:5]
    lines += ["Largest loss increase when removed alone: " + ", ".join(
        f"{r['kind']} {r['layer']}.{r['head']} (+{r['ablation']:.4f})" for r in needed) + ".", ""]
    if not about["train_counts"]:
        lines += ["The data has no training split here, so the rare-token columns are empty.", ""]
    lines += ["## Columns", "", *(f"- `{c}`: {COLUMNS[c]}" for c in COLUMNS), "", QUERY_TOKENS, "",
              "## Heads", "", markdown_table(["module", *shown], [(r["path"], *(short(r[c]) for c in shown)) for r in rows])]
    return "\n".join(lines)


def _removed_line(removed: dict | None) -> str:
    """What the model lost beside heads, in one sentence; empty when it lost nothing else."""
    if not removed:
        return ""
    parts = [f"{stack} layer{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of {n}"
             for stack, (gone, n) in removed["layers"].items() if gone]
    parts += [f"{kind}: {kept} of {n} units kept" for kind, (kept, n) in removed["units"].items() if kept < n]
    return ("Removed beside heads (layers in the original numbering; their heads are absent): " + "; ".join(parts)
            + ".") if parts else ""


HEATMAPS = {  # column -> (what it shows, colour bar label, colour map, range: (low, high), "data" or "symmetric")
    "p_open": ("gate P(open)", "P(open)", "viridis", (0, 1)),
    "importance": ("Michel importance (normalised per module)", "importance", "viridis", "data"),
    "ablation": ("loss increase when the head alone is removed", "nats per target token", "RdBu_r", "symmetric"),
    "confidence": ("confidence: mean largest attention weight", "confidence", "viridis", (0, 1)),
    "entropy": ("attention entropy", "nats", "viridis", "data"),
    "to_prev": ("largest weight on the previous token", "fraction of tokens", "viridis", (0, 1)),
    "to_same": ("largest weight on the token itself", "fraction of tokens", "viridis", (0, 1)),
    "to_next": ("largest weight on the next token", "fraction of tokens", "viridis", (0, 1)),
    "to_rarest": ("largest weight on the sentence's rarest token", "fraction of tokens", "viridis", (0, 1)),
}


def heatmaps(report: Report) -> dict[str, object]:
    """``{file name: figure}``: a layer x head heatmap per column that has values."""
    from gatedprune.reports.plots import head_heatmap, symmetric_range

    about = report.about
    subject = f"{about['name']}, {about['pairs']} {about['split']} pairs"
    figures = {}
    for column, (what, label, cmap, scale) in HEATMAPS.items():
        panels: dict[str, list] = {}
        for path, kind, layer, width in report.modules:  # a module without heads: a grey row
            panels.setdefault(kind, []).append((layer, _column_of(report, path, width, column)))
        panels = {k: rows for k, rows in panels.items() if any(v is not None for _, vs in rows for v in vs)}
        if not panels:
            continue
        values = [r[column] for r in report.rows if r[column] is not None]
        low, high = (symmetric_range(values) if scale == "symmetric" else (min(0.0, min(values)), None)
                     if scale == "data" else scale)
        if column == "to_rarest":
            chance = [r["rarest_chance"] for r in report.rows if r["rarest_chance"] is not None]
            what += f" (uniform attention: {sum(chance) / len(chance):.2f})"
        missing = any(v is None for rows in panels.values() for _, vs in rows for v in vs)
        title = f"{what}\n{subject}" + ("; grey: no such head" if missing else "")
        marks = None
        if column == "p_open":  # the heads the binary rule removes (log_alpha <= 0), crossed as in gates/step_*.png
            marks = {kind: [(layer, [v is not None and v <= 0 for v in _column_of(report, path, width, "log_alpha")])
                            for path, k, layer, width in report.modules if k == kind] for kind in panels}
            title = title.replace("\n", " (x: log_alpha <= 0)\n", 1)
        figures[f"heatmap_{column}.png"] = head_heatmap(panels, label=label, title=title, vmin=low, vmax=high,
                                                        cmap=cmap, marks=marks)
    return figures


def _column_of(report: Report, path: str, width: int, column: str) -> list:
    """One module's values of ``column`` by original head number, None for the heads it lacks."""
    values = [None] * width
    for r in report.rows:
        if r["path"] == path:
            values[r["head"]] = r[column]
    return values


def write_report(report: Report, out: Path) -> list[Path]:
    """heads.csv, heads.md and the heatmaps into ``out`` (each written whole, through a temporary file)."""
    from gatedprune.reports.plots import save_figure
    from gatedprune.utils import atomic_write_text

    figures = heatmaps(report)  # drawn before anything is written
    written = [out / "heads.csv", out / "heads.md"]
    atomic_write_text(written[0], heads_csv(report))
    atomic_write_text(written[1], heads_markdown(report))
    for name, fig in figures.items():
        written.append(save_figure(fig, out / name))
    return written
