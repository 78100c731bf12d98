"""Summarise a sweep: one row per run of a Hydra multirun, BLEU against heads kept, optionally logged to W&B.

`gatedprune-sweep multirun/<date>/<time> [--out DIR] [--wandb]` (or `python -m gatedprune sweep ...`) writes `summary.csv`, `summary.md` and
`pareto.png` (BLEU against heads kept), and `pareto_params.png` (BLEU against parameters kept, so that runs pruning FFN
units and layers compare) where a finished run has its parameter count. Runs that failed or have not finished are
listed with their status, never plotted.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path
from statistics import mean, stdev

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from hydra.utils import get_object  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from gatedprune.utils import atomic_write_text, atomic_write_with, markdown_table  # noqa: E402

KINDS = ("encoder", "decoder", "cross")
# what status.json says (train.py writes running, done, interrupted or failed), "unknown" when neither file is there
STATUSES = ("done", "failed", "interrupted", "running", "unknown")
COLUMNS = [
    "run", "method", "lambda", "seed", "heads_encoder", "heads_decoder", "heads_cross", "heads_alive", "heads_total",
    "units_encoder", "units_decoder", "layers_encoder", "layers_decoder", "bleu", "chrf", "test_bleu", "test_chrf", "test_bleu_before_finetune", "dense_bleu", "params", "seconds", "status", "error",
]
# FFN units and layers kept per stack: column -> kind in metrics.json's "kept" (runs written before it: empty)
STRUCTURES = {"units_encoder": "encoder_ffn", "units_decoder": "decoder_ffn", "layers_encoder": "encoder_layer",
              "layers_decoder": "decoder_layer"}
# what may differ between the runs of one seed group besides the seed: where they started from and wrote to
_NOT_SETTINGS = ("seed", "resume", "paths", "hydra")


class NoRunsError(ValueError):
    """The directory holds no run to summarise."""


def find_run_dirs(root: Path) -> list[Path]:
    """Folders holding `.hydra/`, `metrics.json` or `status.json`; a run's own sub-folders are not searched, except
    `levels/`: a run of a method that exports several levels (michel, astar, random) gives one row per level."""
    if any((root / name).exists() for name in (".hydra", "metrics.json", "status.json")):
        levels = sorted((p for p in (root / "levels").glob("*") if (p / "metrics.json").is_file()), key=_natural)
        state = _status(root)
        if levels and state in ("done", None):
            return levels
        return [root, *levels]  # a run that failed after some levels: its own row says so
    children = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return [run for child in sorted(children, key=_natural) for run in find_run_dirs(child)]


def read_run(run_dir: Path, root: Path) -> dict:
    """One summary row: what metrics.json says, and the run's status from status.json."""
    row = dict.fromkeys(COLUMNS)
    row["run"] = run_dir.name if run_dir == root else run_dir.relative_to(root).as_posix()
    row["error"] = ""
    try:
        metrics = _read_json(run_dir / "metrics.json")
        state = _read_json(run_dir / "status.json") or {}
        if run_dir.parent.name == "levels" and metrics is not None:  # an exported level of a run: done as exported
            state = {"status": "done"}
    except (json.JSONDecodeError, OSError) as err:
        return {**row, "method": "gated", "status": "failed", "error": f"unreadable: {err}"}

    status = state.get("status") or ("done" if metrics is not None else "unknown")
    if status in ("failed", "interrupted"):
        row["error"] = state.get("error", "")
    elif status == "done" and metrics is None:
        status, row["error"] = "failed", "status.json says done but metrics.json is missing"
    elif status == "unknown":
        row["error"] = "no metrics.json or status.json: running, or stopped before writing them"
    row["status"] = status
    row["group"] = _settings(run_dir)

    if metrics is None:  # what the run was asked to do is still in its config
        row["method"] = "gated"
        row["lambda"] = _config_lambda(run_dir)
        return row
    alive = metrics.get("heads_alive", {})
    row.update({
        "method": metrics.get("method", "gated"),
        "lambda": metrics.get("l0_lambda"),
        **{f"heads_{kind}": alive.get(kind) for kind in KINDS},  # only the gated kinds are there
        **{column: (metrics.get("kept") or {}).get(kind) for column, kind in STRUCTURES.items()},
        "heads_alive": alive.get("total"),
        "heads_total": metrics.get("heads_total"),
        "bleu": metrics.get("bleu"),
        "chrf": metrics.get("chrf"),
        "dense_bleu": (metrics.get("dense") or {}).get("bleu"),
        "seed": metrics.get("seed"),
        "test_bleu": _final_test(metrics).get("bleu"),
        "test_chrf": _final_test(metrics).get("chrf"),
        "test_bleu_before_finetune": ((metrics.get("test") or {}).get("pruned_before_finetune") or {}).get("bleu"),
        "seconds": (metrics.get("seconds") or {}).get("method"),
        "params": _params_kept(metrics),
    })
    return row


def summarise(multirun_dir: str | Path, out_dir: str | Path | None = None) -> list[dict]:
    """Read every run under ``multirun_dir``; write summary.csv, summary.md, pareto.png (and pareto_params.png where
    a finished run has its parameter count) to ``out_dir``.

    ``out_dir`` defaults to ``multirun_dir``. Rows are sorted by lambda (runs without one last), then method.
    Raises NoRunsError, writing nothing, when there is no run to summarise.
    """
    root = Path(multirun_dir)
    if not root.is_dir():
        raise NoRunsError(f"{root} is not a directory")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise NoRunsError(f"no runs under {root} (a run folder holds .hydra/, metrics.json or status.json)")
    rows = sorted(
        (read_run(d, root) for d in run_dirs),
        key=lambda r: (r["lambda"] is None, r["lambda"] or 0.0, r["method"], _natural(Path(r["run"]))),
    )
    out = Path(out_dir) if out_dir is not None else root
    atomic_write_text(out / "summary.csv", to_csv(rows))
    atomic_write_text(out / "summary.md", to_markdown(rows, root))
    plot_pareto(rows, out / "pareto.png", title=sweep_name(root))
    if any(g["params"] is not None for g in seed_groups(rows)):
        plot_pareto(rows, out / "pareto_params.png", title=sweep_name(root), x="params")
    return rows


def sweep_name(root: Path) -> str:
    """`<date>/<time>` of `multirun/<date>/<time>`: the last two parts of the path."""
    return "/".join(Path(root).resolve().parts[-2:])


def dense_baseline(rows: list[dict]) -> tuple[float, int] | None:
    """Mean of the pruning runs' dense-phase BLEU and how many runs it averages; None when no run had a dense
    phase. Dense runs (no gated step: method "dense") are points of their own, not part of this line.

    The runs of a lambda sweep share seed and dense phase, so their dense scores agree; the mean also covers
    sweeps where they differ.
    """
    scores = [r["dense_bleu"] for r in rows if r["dense_bleu"] is not None and r["method"] != "dense"]
    return (mean(scores), len(scores)) if scores else None


def seed_groups(rows: list[dict]) -> list[dict]:
    """Finished runs grouped by their settings with the seed (and resume point, output paths) left out: mean and
    sample standard deviation of BLEU, test BLEU, heads and parameters kept over the seeds of each group, in row
    order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if row["status"] == "done" and row["bleu"] is not None and row["heads_alive"] is not None:
            groups.setdefault(f"{row['method']} {row['group'] or row['lambda']}", []).append(row)

    def spread(values: list) -> tuple[float | None, float | None]:
        values = [v for v in values if v is not None]
        if not values:
            return None, None
        return mean(values), (stdev(values) if len(values) > 1 else 0.0)

    summary = []
    for members in groups.values():
        first = members[0]
        (bleu, bleu_sd), (test, test_sd), (heads, heads_sd), (params, params_sd) = (
            spread([r[key] for r in members]) for key in ("bleu", "test_bleu", "heads_alive", "params"))
        summary.append({
            "runs": [r["run"] for r in members], "seeds": [r["seed"] for r in members], "method": first["method"],
            "lambda": first["lambda"], "n": len(members), "bleu": bleu, "bleu_sd": bleu_sd, "test_bleu": test,
            "test_bleu_sd": test_sd, "heads_alive": heads, "heads_sd": heads_sd, "heads_total": first["heads_total"],
            "params": params, "params_sd": params_sd,
        })
    return summary


def matched_counts(rows: list[dict]) -> list[dict]:
    """Finished runs grouped by heads kept, method and settings (seeds pooled, as in ``seed_groups``): mean and sample
    standard deviation of the test scores, mean heads kept per kind and the mean time the method took to decide,
    most heads first."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "done" and row["heads_alive"] is not None:
            groups.setdefault((row["heads_alive"], row["method"], row.get("group") or ""), []).append(row)

    def spread(members: list[dict], key: str) -> tuple[float | None, float]:
        values = [r.get(key) for r in members if r.get(key) is not None]
        return (mean(values), stdev(values) if len(values) > 1 else 0.0) if values else (None, 0.0)

    table = []
    for (heads, method, _), members in sorted(groups.items(), key=lambda item: (-item[0][0], item[0][1])):
        entry = {"heads": heads, "method": method, "n": len(members), "runs": [r["run"] for r in members]}
        for key in ("test_bleu", "test_bleu_before_finetune", "test_chrf", "bleu", "seconds"):
            entry[key], entry[f"{key}_sd"] = spread(members, key)
        entry.update({kind: spread(members, f"heads_{kind}")[0] for kind in KINDS})
        table.append(entry)
    return table


def matched_counts_markdown(rows: list[dict]) -> str:
    """``matched_counts`` as a markdown table; empty when the runs hold fewer than two methods."""
    table = matched_counts(rows)
    if len({entry["method"] for entry in table}) < 2:
        return ""

    def pm(entry: dict, key: str) -> str:
        if entry[key] is None:
            return "-"
        return f"{entry[key]:.2f}" + (f" ± {entry[f'{key}_sd']:.2f}" if entry["n"] > 1 else "")

    cells = [(e["heads"], e["method"], e["runs"][0] + (f" (+{e['n'] - 1} seeds)" if e["n"] > 1 else ""), e["n"],
              pm(e, "test_bleu"), pm(e, "test_bleu_before_finetune"), pm(e, "test_chrf"), pm(e, "bleu"),
              " / ".join(_fmt(e[kind], ".3g") for kind in KINDS), _fmt(e["seconds"], ".0f")) for e in table]
    return markdown_table(["heads kept", "method", "run", "runs", "test BLEU", "test BLEU before fine-tuning",
                           "test chrF", "validation BLEU",
                           "kept: encoder / decoder / cross", "seconds to decide"], cells)


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def to_markdown(rows: list[dict], root: Path) -> str:
    found = sorted({r["status"] for r in rows}, key=lambda s: ((*STATUSES, s).index(s), s))
    counts = {s: sum(r["status"] == s for r in rows) for s in found}
    lines = [f"# Sweep summary: {root}", "", f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
    dense = dense_baseline(rows)
    if dense is not None:
        lines.append(f"Dense-phase BLEU (mean over {dense[1]} runs): {dense[0]:.2f}")
    shown = [c for c in STRUCTURES if any(r.get(c) is not None for r in rows)]  # sweeps of heads only: none
    header = ["run", "method", "lambda", *KINDS, "heads alive", *(STRUCTURES[c] for c in shown), "BLEU", "chrF",
              "params", "status", "error"]
    cells = []
    for r in rows:
        heads = "-" if r["heads_alive"] is None else f"{r['heads_alive']} / {_fmt(r['heads_total'], 'd')}"
        cells.append((
            r["run"], r["method"], _fmt(r["lambda"], "g"), *(_fmt(r[f"heads_{k}"], "d") for k in KINDS), heads,
            *(_fmt(r[c], "d") for c in shown),
            _fmt(r["bleu"], ".2f"), _fmt(r["chrf"], ".2f"), _fmt(r["params"], ","), r["status"],
            r["error"].replace("|", "\\|").replace("\n", " "),
        ))
    table = "\n".join(lines) + "\n\n" + markdown_table(header, cells)
    groups = [g for g in seed_groups(rows) if g["n"] > 1]
    if groups:  # runs that differ only in their seed: mean ± sample standard deviation
        group_cells = [(
            ", ".join(g["runs"]), g["method"], _fmt(g["lambda"], "g"), g["n"],
            f"{g['heads_alive']:.1f} ± {g['heads_sd']:.1f}", f"{g['bleu']:.2f} ± {g['bleu_sd']:.2f}",
            "-" if g["test_bleu"] is None else f"{g['test_bleu']:.2f} ± {g['test_bleu_sd']:.2f}",
        ) for g in groups]
        table += "\n## Seeds\n\nRuns that differ only in their seed (mean ± sample standard deviation):\n\n"
        table += markdown_table(["runs", "method", "lambda", "seeds", "heads alive", "BLEU", "test BLEU"], group_cells)
    matched = matched_counts_markdown(rows)
    if matched:
        table += ("\n## Methods at matched head counts\n\nThe exported models' test scores, mean ± sample standard "
                  "deviation over runs (seeds) where there are several (before fine-tuning: the export as verified, where it "
                  "was fine-tuned); the time a method took to decide what goes "
                  "(gates: training, others: scoring and search):\n\n" + matched)
    return table


def plot_pareto(rows: list[dict], path: Path, title: str = "", x: str = "heads_alive") -> dict[str, str]:
    """BLEU against heads kept (``x="params"``: parameters kept, where known), one marker per finished run: gated
    runs (lambda annotated) first, then other methods. Returns each method's colour."""
    spread = {"heads_alive": "heads_sd", "params": "params_sd"}[x]
    done = [r for r in rows if r["status"] == "done" and r["bleu"] is not None and r["heads_alive"] is not None]
    methods = sorted({r["method"] for r in done}, key=lambda m: (m != "gated", m))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [g for g in seed_groups(rows) if g[x] is not None]  # one point per group of seeds: the mean, with the
    for i, method in enumerate(methods):  # spread as error bars
        points = [g for g in groups if g["method"] == method]
        ax.errorbar([g[x] for g in points], [g["bleu"] for g in points],
                    xerr=[g[spread] for g in points], yerr=[g["bleu_sd"] for g in points], fmt="o",
                    color=f"C{i}", label=method, zorder=3, capsize=3)
        points.sort(key=lambda r: r[x])  # a method's points joined, fewest heads (parameters) first
        ax.plot([r[x] for r in points], [r["bleu"] for r in points], color=f"C{i}", alpha=0.4)
        if method == "gated":
            for r in (r for r in points if r["lambda"] is not None):  # a head budget's runs have no lambda
                ax.annotate(f"λ={_fmt(r['lambda'], 'g')}", (r[x], r["bleu"]), xytext=(4, 4),
                            textcoords="offset points", fontsize=8)
    dense = dense_baseline(rows)
    if dense is not None:
        ax.axhline(dense[0], color="grey", linestyle="--",
                   label=f"dense phase, mean of {dense[1]} runs ({dense[0]:.2f})")
    totals = {r["heads_total"] for r in done} - {None}
    ax.set_xlabel("parameters kept (exported model)" if x == "params" else
                  f"heads kept (of {totals.pop()})" if len(totals) == 1 else "heads kept")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("validation BLEU")
    ax.set_title(f"{title}: {len(done)} of {len(rows)} runs finished")
    if methods or dense is not None:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        atomic_write_with(path, lambda f: fig.savefig(f, format="png", dpi=120))  # beside it, flushed, renamed
    finally:
        plt.close(fig)
    return {method: f"C{i}" for i, method in enumerate(methods)}


def log_to_wandb(rows: list[dict], plot: Path, name: str, out_dir: Path) -> None:
    """The table and the plot as one W&B run; offline unless WANDB_MODE says otherwise (`wandb sync` later)."""
    import wandb

    run = wandb.init(
        project="gatedprune", job_type="sweep-summary", name=name, dir=str(out_dir),
        mode=os.environ.get("WANDB_MODE", "offline"),
    )
    table = wandb.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows], allow_mixed_types=True)
    params = Path(plot).with_name("pareto_params.png")  # written beside it where parameter counts are known
    run.log({"sweep/summary": table, "sweep/pareto": wandb.Image(str(plot)),
             **({"sweep/pareto_params": wandb.Image(str(params))} if params.is_file() else {})})
    run.finish()


def _settings(run_dir: Path) -> str | None:
    """The run's composed config without what may differ between seeds of one setting, as a comparable string
    (for a level of a run, the run's config and the level)."""
    if run_dir.parent.name == "levels":
        settings = _settings(run_dir.parents[1])
        return None if settings is None else f"{settings} level {run_dir.name}"
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    settings = _canonical_targets(OmegaConf.to_container(OmegaConf.load(config), resolve=False))
    return json.dumps({k: v for k, v in settings.items() if k not in _NOT_SETTINGS}, sort_keys=True, default=str)


def _canonical_targets(node):
    """``node`` with every ``_target_`` named where its object lives now: a run recorded before the package had
    subfolders (``gatedprune.methods.L0``) has the settings of one recorded after (``gatedprune.methods.gated.L0``)."""
    if isinstance(node, list):
        return [_canonical_targets(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _canonical_targets(v) for k, v in node.items()}
    target = node.get("_target_")
    if isinstance(target, str) and target.startswith("gatedprune."):
        try:
            found = get_object(target)
            node["_target_"] = f"{found.__module__}.{found.__qualname__}"
        except Exception:  # gone for good: compared as written
            pass
    return node


def _final_test(metrics: dict) -> dict:
    """The test-split score of the run's final model (exported, or gated; a dense run's own), if there is one."""
    test = metrics.get("test") or {}
    return test.get("pruned") or test.get("gated") or (test.get("dense") if metrics.get("method") == "dense" else None) or {}


def _params_kept(metrics: dict) -> int | None:
    """Parameters of the pruned model, as exported; a dense run keeps them all; None for an unexported pruning run
    (its metrics.json counts the parameters before pruning)."""
    if metrics.get("export"):
        return metrics["export"]["params"]
    return metrics.get("params") if metrics.get("method") == "dense" else None


def _status(run_dir: Path) -> str | None:
    try:
        return (_read_json(run_dir / "status.json") or {}).get("status")
    except (json.JSONDecodeError, OSError):
        return "unreadable"


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _config_lambda(run_dir: Path) -> float | None:
    config = run_dir / ".hydra" / "config.yaml"
    return OmegaConf.select(OmegaConf.load(config), "pruning.l0_lambda") if config.is_file() else None


def _natural(path: Path) -> list:
    """Sort key that puts run 10 after run 9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.as_posix())]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":  # python -m gatedprune.reports.sweep (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import sweep_command

    sys.exit(sweep_command())
