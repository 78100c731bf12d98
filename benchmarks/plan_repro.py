"""The same plan every run (issue 38, item 3): the default's gated phase twice on one machine, the first while a second
process keeps one core busy, and how far apart their latency fits and the plans they ship are.

Each run is ``make train``'s gated phase from the kept teacher (``pruning=speed``, 100 gated steps, target 0.67,
seed 1234), exported and not fine-tuned, with the latency fit measured at set-up (``fit=measured``: no table, a
fresh cache) or read from the recovery grid's kept fit (``fit=table``). Its json records the fit (base, costs per
structure, largest error over its probes, each probe's timings) and the plan; ``table`` compares each pair. A run
already in ``--results`` is skipped.

    .venv/bin/python benchmarks/plan_repro.py run --runs RUNS/repro       # busy then quiet, for each fit
    .venv/bin/python benchmarks/plan_repro.py table                       # docs/benchmarks/plan_repro/README.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery  # noqa: E402  (how a run is started, the teacher's kept latency fit)
from common import ROOT, machine, write_readme  # noqa: E402

from gatedprune.utils import markdown_table  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "plan_repro"
FITS = ("measured", "table")
LOADS = ("busy", "quiet")  # in this order: the busy run first, as the issue asks


def args(fit: str, load: str, runs: Path) -> list[str]:
    table = [] if fit == "measured" else [f"pruning.workload.table={recovery.TABLE}"]
    return ["pruning=speed", "model=teacher", *table, "gated_steps=100", "finetune.steps=0", "export.formats=[hf]",
            "report.speed=false", "seed=1234", f"hydra.run.dir={runs / f'{fit}_{load}'}"]


@contextmanager
def busy_core(on: bool):
    """A second process spinning on one core while the block runs (when ``on``); yields it (or None)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield spinner
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def plan_of(report: dict) -> dict[str, list[int]]:
    """Every site's kept structures in one mapping: heads (``plan``), FFN units and layers."""
    return {**{f"heads {k}": v for k, v in report["plan"].items()},
            **{f"units {k}": v for k, v in report["plan_units"].items()},
            **{f"layers {k}": v for k, v in report["plan_layers"].items()}}


def plan_difference(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    """Structures kept by one plan and not the other, over every site either names."""
    return sum(len(set(a.get(site, [])) ^ set(b.get(site, []))) for site in set(a) | set(b))


def run_one(fit: str, load: str, runs: Path, results: Path) -> dict:
    name = f"{fit}_{load}"
    command = [recovery._python(), str(ROOT / "train.py"), *args(fit, load, runs)]
    start = time.time()
    with busy_core(load == "busy"):
        recovery._run(command, runs / f"{name}.log")
    run = runs / name
    metrics = json.loads((run / "metrics.json").read_text())
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    costs = metrics["costs"]
    probes = []
    if costs.get("path"):
        probes = json.loads(Path(costs["path"]).read_text()).get("probes", [])
    record = {"name": name, "fit": fit, "load": load, "command": recovery._shown(command[1:], runs),
              "costs": {k: costs.get(k) for k in ("source", "fit_error", "base", "coefficients")},
              "probes": [{k: p.get(k) for k in ("probe", "seconds", "timings", "predicted")} for p in probes],
              "plan": plan_of(report), "kept": metrics["kept"], "predicted": report["predicted"],
              "wall_s": round(time.time() - start, 1), "machine": machine()}
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def table(results: Path) -> str:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    rows = []
    for fit in FITS:
        pair = [found.get(f"{fit}_{load}") for load in LOADS]
        for r in pair:
            if r is None:
                continue
            c = r["costs"]
            rows.append([fit, r["load"], f"{c['fit_error']:.1%}" if c["fit_error"] is not None else "-",
                         f"{1000 * c['base']:.1f}", f"{1000 * c['coefficients']['decoder_layer']:.2f}",
                         f"{1000 * c['coefficients']['encoder_layer']:.2f}",
                         f"{1e6 * c['coefficients']['decoder_ffn']:.2f}", f"{r['predicted']['latency']:.3f}",
                         f"{r['kept']['encoder_layer']} + {r['kept']['decoder_layer']}",
                         plan_difference(pair[0]["plan"], pair[1]["plan"]) if None not in pair else "-"])
    return markdown_table(["fit", "load", "fit error", "base ms", "decoder layer ms", "encoder layer ms",
                           "decoder FFN unit us", "export latency kept", "layers enc + dec",
                           "structures the two plans differ in"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "table"])
    parser.add_argument("--runs", type=Path, default=Path("runs/repro"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--fit", choices=FITS, default=None, help="one pair (default: both)")
    args_ = parser.parse_args(argv)
    if args_.stage == "run":
        for fit in [args_.fit] if args_.fit else FITS:
            for load in LOADS:
                if (args_.results / f"{fit}_{load}.json").is_file():
                    print(f"{fit}_{load}: done (in {args_.results})")
                    continue
                run_one(fit, load, args_.runs.resolve(), args_.results)
    write_readme(args_.results, "The same plan every run (benchmarks/plan_repro.py)",
                 "The default's gated phase (100 steps, target 0.67, seed 1234) from the teacher, twice per fit: first "
                 "with a second process spinning on one core, then without; the fit's costs, and how many structures "
                 "the two exports' plans differ in.", table(args_.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
