"""Pruned models against dense models trained for the same number of steps, per seed (docs/quality.md).

    python benchmarks/quality_table.py <folder of runs> [--out docs/quality/gaps.md] [--plot docs/quality/gaps.png]

Every finished run under the folder (a directory with metrics.json and status.json "done") is read. A dense run
(method "dense") is the reference of its seed at its step count. A pruning run gives up to two rows: its export as
verified (test.pruned_before_finetune, or test.pruned when it was not fine-tuned), compared with the dense run of
its seed at the same step count, and its fine-tuned model (test.pruned), compared with the dense run at that step
count plus the fine-tuning steps. Rows are grouped by protocol (the run's Hydra overrides, less seed, resume,
experiment and quality_heads) and heads kept; a group gives the mean ± sample standard deviation over seeds of test
BLEU and of the per-seed gap (pruned - dense; a seed without a dense run of exactly that length is left out of the
gap, which then names the seeds it covers). Runs without a test score (no test split, no export) and runs of the
methods that score a trained model (they train no steps) are skipped. ``--plot`` draws the gap against heads kept,
one line per protocol and model measured at two or more head counts, with the seeds' sample sd as error bars.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, stdev

import yaml

_NOT_PROTOCOL = ("seed=", "resume=", "experiment=", "quality_heads=", "hydra.")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{mean(values):.2f} ± {stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def read_runs(root: Path) -> tuple[dict, list[dict]]:
    """({(seed, steps): dense test BLEU}, [one entry per pruned model: protocol, heads, seed, steps, bleu, seconds])."""
    dense, pruned = {}, []
    for status in sorted(root.rglob("status.json")):
        run = status.parent
        if json.loads(status.read_text()).get("status") != "done" or not (run / "metrics.json").is_file():
            continue
        metrics = json.loads((run / "metrics.json").read_text())
        test, seed, steps = metrics.get("test") or {}, metrics.get("seed"), metrics.get("steps")
        if steps is None:  # Michel, A*, random: no training steps to match a dense run with
            continue
        if metrics["method"] == "dense":
            if "dense" in test:
                if (seed, steps) in dense:
                    print(f"warning: two dense runs of seed {seed} at step {steps}; {run} is the one used")
                dense[(seed, steps)] = test["dense"]["bleu"]
            continue
        tuned = (metrics.get("finetune") or {}).get("steps", 0)
        export = test.get("pruned_before_finetune") if tuned else test.get("pruned")
        if export is None:  # not exported, or no test split
            continue
        overrides_file = run / ".hydra" / "overrides.yaml"
        overrides = (yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else None) or []
        protocol = " ".join(sorted(o for o in overrides if not o.startswith(_NOT_PROTOCOL))) or "(defaults)"
        common = dict(heads=metrics["heads_alive"]["total"], seed=seed, seconds=metrics["seconds"]["run"])
        pruned.append({**common, "protocol": protocol, "model": "export", "steps": steps, "bleu": export["bleu"]})
        if tuned:
            pruned.append({**common, "protocol": protocol, "model": f"fine-tuned {tuned} steps", "steps": steps + tuned,
                           "bleu": test["pruned"]["bleu"]})
    return dense, pruned


def groups(dense: dict, pruned: list[dict]) -> list[dict]:
    """One entry per protocol, model and heads kept (sorted so): its members, their dense references and gaps."""
    grouped: dict[tuple, list[dict]] = {}
    for entry in pruned:
        grouped.setdefault((entry["protocol"], entry["model"], entry["heads"]), []).append(entry)
    out = []
    for (protocol, model, heads), members in sorted(grouped.items(), key=lambda g: (g[0][0], g[0][1], -g[0][2])):
        references = [dense.get((m["seed"], m["steps"])) for m in members]
        out.append(dict(protocol=protocol, model=model, heads=heads, members=members, references=references,
                        gaps=[m["bleu"] - ref for m, ref in zip(members, references) if ref is not None],
                        paired=[str(m["seed"]) for m, ref in zip(members, references) if ref is not None]))
    return out


def table(grouped: list[dict]) -> str:
    lines = ["| protocol (overrides) | model | heads kept | steps | seeds | test BLEU | same-length dense | gap (BLEU) "
             "| wall time of the run (s, mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for g in grouped:
        members, gaps, paired = g["members"], g["gaps"], g["paired"]
        gap = _spread(gaps) + (f" (seeds {', '.join(paired)})" if gaps and len(paired) < len(members) else "")
        steps = sorted({m["steps"] for m in members})
        lines.append(
            f"| {g['protocol']} | {g['model']} | {g['heads']} | {', '.join(map(str, steps))} | "
            f"{', '.join(str(m['seed']) for m in members)} | {_spread([m['bleu'] for m in members])} | "
            f"{_spread([r for r in g['references'] if r is not None])} | {gap} | "
            f"{mean(m['seconds'] for m in members):.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(grouped: list[dict], path: Path, title: str) -> dict[str, list[tuple[int, float, float]]]:
    """Write the gap-against-heads plot of ``groups``; returns what it drew: {label: [(heads, mean gap, sd), ...]}."""
    from gatedprune.reports.plots import plt, save_figure

    series: dict[str, list[tuple[int, float, float]]] = {}
    for g in grouped:
        if g["gaps"]:
            sd = stdev(g["gaps"]) if len(g["gaps"]) > 1 else 0.0
            series.setdefault(f"{g['protocol']} ({g['model']})", []).append((g["heads"], mean(g["gaps"]), sd))
    series = {label: sorted(points) for label, points in series.items() if len(points) > 1}
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        heads, gaps, sds = zip(*points)
        ax.errorbar(heads, gaps, yerr=sds, marker="o", capsize=3, label=label)
    ax.axhline(0.0, color="grey", linewidth=1)
    ax.axhline(-0.25, color="grey", linestyle="--", linewidth=1, label="0.25 BLEU below the dense model")
    ax.set(xlabel="heads kept", ylabel="test BLEU - same-length dense model", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return series


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a folder of finished runs (dense and pruned)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the gaps against heads kept (PNG)")
    args = parser.parse_args(argv)
    dense, pruned = read_runs(args.root)
    if not pruned:
        raise SystemExit(f"{args.root}: no finished pruning run")
    grouped = groups(dense, pruned)  # one grouping for the table and the plot
    text = table(grouped)
    print(text)
    if args.out:
        args.out.write_text(f"# Pruned against same-length dense models: {args.root}\n\n" + text)
    if args.plot:
        series = plot(grouped, args.plot, f"pruned against same-length dense models: {args.root.name}")
        print(f"wrote {args.plot} ({len(series)} lines)")


if __name__ == "__main__":
    main()
