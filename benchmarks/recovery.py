"""Recovery: prune the kept teacher, fine-tune the cut model back, and compare with the same shape from scratch.

Two stages, each cell a command; a cell whose json is already in ``--results`` (docs/benchmarks/recovery/) is
skipped, so the grid is run across sessions and nothing finished is lost with a machine.

1. Exports (``EXPORTS``): the cut models, from the teacher (``model=teacher``), without fine-tuning:
   the gates (``pruning=speed`` at a target of the predicted batch-1 latency), random structures at the same target,
   evenly kept decoder layers at the depth the gates' export kept (read from it, per seed).
2. Recoveries (``RECOVERIES``): ``gatedprune-finetune EXPORT --teacher kept`` with one schedule whose rate at step N
   does not depend on the total (linear warm-up over ``WARMUP`` steps, then inverse square root), validation every
   250 steps, the weights of each reported budget saved and scored on the test split afterwards
   (``gatedprune-evaluate``, greedy). ``init=scratch`` is the gates' export with every weight drawn again.

    .venv/bin/python benchmarks/recovery.py run --runs RUNS/recovery --only lr     # the learning-rate probe
    .venv/bin/python benchmarks/recovery.py run --runs RUNS/recovery               # every cell not yet done
    .venv/bin/python benchmarks/recovery.py table                                  # docs/benchmarks/recovery.md

Each cell's json records its command, the validation curve, the test BLEU at each budget, the wall time and time
per step of each phase, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

from gatedprune.utils import markdown_table  # noqa: E402

EVERY = "[encoder,decoder,cross,encoder_ffn,decoder_ffn,encoder_layer,decoder_layer]"
RESULTS = ROOT / "docs" / "benchmarks" / "recovery"
# one latency fit of the teacher for every cell (gatedprune-latency teacher <this file>): a fit measured at each
# run's set-up moved the floor of what can be removed between 0.45 and 0.57 of the dense latency on this machine
TABLE = RESULTS / "teacher_latency.json"
BUDGETS = (250, 500, 1000, 2000, 4000)
WARMUP = 100
PEAKS = (3e-4, 1e-3, 2e-3)  # the probe of the default peak: 1,000 steps from the gates at the low target
PEAK = 1e-3  # the grid's peak until the probe has chosen
# the targets were 0.67 and 0.5; on this machine's fit of the teacher (TABLE) removing every gated structure
# leaves 0.51 of the dense latency, so 0.5 is out of reach and the nearer target is 0.55 (predicted 1.8x)
LOW, HIGH = 0.55, 0.67


@dataclass(frozen=True)
class Export:
    """A cut model: ``start`` (gates, random, even_layers) at ``target`` of the predicted latency, ``seed``."""

    start: str
    target: float
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"export_{self.start}_{self.target}_s{self.seed}"

    def args(self, runs: Path) -> list[str]:
        common = ["model=teacher", "finetune.steps=0", "export.formats=[hf]", "report.speed=false",
                  f"pruning.workload.table={TABLE}", f"seed={self.seed}", f"hydra.run.dir={runs / self.name}"]
        if self.start == "gates":
            return ["pruning=speed", f"pruning.target_latency={self.target}", *common]
        if self.start == "random":
            return ["pruning=random", f"pruning.kinds={EVERY}", f"pruning.latency=[{self.target}]", *common]
        if self.start == "even_layers":  # the depth the gates kept at this target and seed
            kept = _plan(Export("gates", self.target, self.seed).model_dir(runs))["kept_layers"]["decoder"]
            return ["pruning=even_layers", f"pruning.decoder_layers={len(kept)}",
                    *(c for c in common if not c.startswith("pruning.workload"))]
        raise ValueError(f"unknown start {self.start!r}")

    def model_dir(self, runs: Path) -> Path:
        run = runs / self.name
        if self.start == "gates":
            return run / "pruned"
        levels = sorted((run / "levels").glob("*/pruned"))
        if len(levels) != 1:
            raise FileNotFoundError(f"{run}: expected one exported level, found {len(levels)}")
        return levels[0]


@dataclass(frozen=True)
class Recovery:
    """``steps`` of fine-tuning of ``export`` at peak ``lr`` (``init`` scratch: its shapes from nothing)."""

    group: str
    export: Export
    steps: int
    lr: float = PEAK
    init: str = "export"

    @property
    def name(self) -> str:
        start = "scratch" if self.init == "scratch" else self.export.start
        return f"{self.group}_{start}_{self.export.target}_s{self.export.seed}_{self.steps}_lr{self.lr:g}"

    @property
    def budgets(self) -> list[int]:
        return [b for b in BUDGETS if b <= self.steps]

    def args(self, runs: Path) -> list[str]:
        return [str(self.export.model_dir(runs)), "--teacher", "kept", "--out", str(runs / self.name),
                f"finetune.steps={self.steps}", f"finetune.lr={self.lr}", f"finetune.warmup_steps={WARMUP}",
                "finetune.decay=inverse_sqrt", "finetune.val_check_interval=250",
                f"finetune.save_at=[{','.join(map(str, self.budgets))}]", f"finetune.init={self.init}",
                "report.speed=false", f"seed={self.export.seed}"]


def _grid() -> list[Recovery]:
    lr = [Recovery("lr", Export("gates", LOW), 1000, lr=peak) for peak in PEAKS]
    # 4,000 steps for the gates and scratch at the low target, 2,000 for the rest
    curves = [Recovery("curve", Export(start, target), 4000 if start == "gates" and target == LOW else 2000,
                       init=init)
              for target in (LOW, HIGH) for start, init in
              (("gates", "export"), ("gates", "scratch"), ("random", "export"), ("even_layers", "export"))]
    seeds = [Recovery("seeds", Export(start, LOW, seed), 1000, init=init) for seed in (1, 2)
             for start, init in (("gates", "export"), ("gates", "scratch"), ("random", "export"),
                                 ("even_layers", "export"))]
    return lr + curves + seeds


def _plan(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())["gatedprune"]


def _python() -> str:
    return str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def _run(args: list[str], log: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    log.parent.mkdir(parents=True, exist_ok=True)
    print(" ".join(args), flush=True)
    with log.open("a") as out:
        subprocess.run(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)


def _test_bleu(model_dir: Path, log: Path) -> float:
    out = model_dir / "eval.json"
    if not out.is_file():
        _run([_python(), "-m", "gatedprune", "evaluate", str(model_dir), "--out", str(out)], log)
    return json.loads(out.read_text())["bleu"]


def run_export(export: Export, runs: Path) -> Path:
    if not (runs / export.name / "status.json").is_file() or \
            json.loads((runs / export.name / "status.json").read_text())["status"] != "done":
        _run([_python(), str(ROOT / "train.py"), *export.args(runs)], runs / f"{export.name}.log")
    return export.model_dir(runs)


def run_recovery(cell: Recovery, runs: Path, results: Path) -> dict:
    """Train and score ``cell``; its json in ``results``."""
    model_dir = run_export(cell.export, runs)
    exported = json.loads((runs / cell.export.name / "metrics.json").read_text())
    command = [_python(), "-m", "gatedprune", "finetune", *cell.args(runs)]
    run_dir = runs / cell.name
    if not (run_dir / "metrics.json").is_file():
        _run(command, runs / f"{cell.name}.log")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    tuned = metrics["finetune"]
    test = {step: _test_bleu(Path(path), runs / f"{cell.name}.log") for step, path in tuned["snapshots"].items()}
    plan = _plan(model_dir)
    record = {
        "cell": cell.name, "group": cell.group, "start": cell.export.start, "init": cell.init,
        "target": cell.export.target, "seed": cell.export.seed, "steps": cell.steps, "lr": cell.lr,
        "warmup_steps": WARMUP, "decay": "inverse_sqrt",
        "export_command": " ".join(["python train.py", *cell.export.args(Path("RUNS"))]).replace(str(ROOT) + "/", ""),
        "command": " ".join(["gatedprune-finetune", *cell.args(Path("RUNS"))]),
        "kept_layers": {stack: len(k) for stack, k in plan["kept_layers"].items()},
        "params": metrics["params"], "params_teacher": metrics["params_before"],
        "teacher_test_bleu": metrics["dense"]["test"]["bleu"],
        "export_test_bleu": (metrics["test"].get("pruned_before_finetune") or {}).get("bleu"),
        "test_bleu_at": test, "curve": tuned["curve"], "shipped_step": tuned["shipped_step"],
        "shipped_test_bleu": metrics["test"]["pruned"]["bleu"],
        "finetune_wall_s": tuned["wall_s"], "finetune_s_per_step": tuned["s_per_step"],
        "export_wall_s": (exported.get("seconds") or {}).get("run"),
        "machine": machine(), "threads": os.environ.get("OMP_NUM_THREADS"),
    }
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{cell.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def table(results: Path) -> str:
    rows = []
    for path in sorted(results.glob("*.json")):
        r = json.loads(path.read_text())
        at = [f"{r['test_bleu_at'].get(str(b), '-'):.2f}" if str(b) in r["test_bleu_at"] else "-" for b in BUDGETS]
        best = max(r["curve"], key=lambda p: (p["bleu"], -(p["loss"] if p["loss"] is not None else float("inf"))))
        rows.append((r["group"], r["start"] if r["init"] == "export" else "scratch", r["target"], r["seed"],
                     f"{r['lr']:g}", *at, f"{best['bleu']:.2f} @ {best['step']}",
                     f"{r['teacher_test_bleu']:.2f}", f"{r['finetune_s_per_step']:.3f}"))
    header = ["group", "start", "target", "seed", "peak lr", *(f"test BLEU @{b}" for b in BUDGETS),
              "best validation BLEU @ step", "teacher test BLEU", "s / step"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "table"])
    parser.add_argument("--runs", type=Path, default=Path("runs/recovery"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--only", default=None, help="a group: lr, curve or seeds")
    parser.add_argument("--cell", default=None, help="one cell by name (several processes at once, one each)")
    parser.add_argument("--exports-only", action="store_true", help="stage 1 alone: the cut models")
    args = parser.parse_args(argv)
    if args.stage == "run":
        for cell in _grid():
            if (args.only and cell.group != args.only) or (args.cell and cell.name != args.cell):
                continue
            if args.exports_only:
                run_export(cell.export, args.runs.resolve())
                continue
            if (args.results / f"{cell.name}.json").is_file():
                print(f"{cell.name}: done (in {args.results})")
                continue
            run_recovery(cell, args.runs.resolve(), args.results)
    text = table(args.results)
    (args.results.parent / "recovery.md").write_text("# Recovery cells (benchmarks/recovery.py)\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
