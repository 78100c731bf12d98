"""Gates that choose (issue 38): how close each gated-phase protocol comes to its latency target, and what it keeps.

Each cell is one gated phase from the kept teacher (``pruning=speed``, every kind, the recovery grid's latency fit
``docs/benchmarks/recovery/teacher_latency.json``), exported and not fine-tuned. Its json records, per logged step,
the expected kept latency beside the ramp's target and the multiplier; at the end, the three costs of
``CostBudget.report`` (expected, the deterministic gates', the export plan's), what the gated model and the export
keep, and both models' validation BLEU (the export gap before recovery). A cell already in ``--results`` is skipped.

    .venv/bin/python benchmarks/gates.py run --runs RUNS/gates                  # every cell not yet done
    .venv/bin/python benchmarks/gates.py run --runs RUNS/gates --cell <name>    # one (several processes at once)
    .venv/bin/python benchmarks/gates.py run --runs RUNS/gates --reuse RUNS/recovery  # settle_300 and nash_300 from
                                                                                # the recovery grid's exports
    .venv/bin/python benchmarks/gates.py rescore --runs RUNS/gates --bleu       # final gates of the kept runs
    .venv/bin/python benchmarks/gates.py table                                  # docs/benchmarks/gates/README.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery  # noqa: E402  (the recovery grid's setting: the teacher, its latency fit, how a run is started)
from common import ROOT, machine, off_target, trajectory, write_readme  # noqa: E402

from gatedprune.utils import markdown_table  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "gates"
SEEDS = (1234,)


@dataclass(frozen=True)
class Protocol:
    """A gated phase: its name, its overrides beside ``pruning=speed``, and the gated steps it takes."""

    name: str
    overrides: tuple[str, ...] = ()
    gated_steps: int = 100
    settle_layers_at: int | None = None  # pruning.settle_layers_at, scaled with gated_steps on the smoke model
    seeds: tuple[int, ...] = SEEDS
    # the recovery grid's start that runs this very gated phase (its export is the same training): a cell whose
    # run is not here is recorded from that export's run, where it is (``--reuse``), rather than trained again
    recovery_start: str | None = None

    @classmethod
    def of_start(cls, name: str, start: str) -> "Protocol":
        """The gated phase of the recovery grid's ``start`` (``recovery.GATES``), at the grid's seeds: one definition
        of what both benchmarks run, so a cell recorded from the grid's export is the same training."""
        phase = recovery.GATES[start]
        return cls(name, phase.overrides, phase.gated_steps, phase.settle_at, recovery.SEEDS, start)


# the default's controller, then one change at a time (docs/gates.md, section 6: the causes to test)
PROTOCOLS = (
    Protocol("default"),  # gate rate 0.3, multiplier rate 0.5, the target ramped over 50 of 100 steps
    Protocol("clamp_4.6", ("pruning.gates.log_alpha_range=[-4.6,4.6]",)),  # CoFi's clamp: an overshoot can undo
    Protocol("hold_300", ("pruning.target_warmup_steps=50",), 300),  # the same ramp, then 250 steps at the target
    Protocol("slow_300", ("pruning.gate_lr=0.1", "pruning.lagrangian_lr=0.05", "pruning.target_warmup_steps=100"),
             300),  # l0_budget's rates, given time to settle
    # the hold, with the layer gates decided at gated step 100 (the expected number per stack) and held, so the widths
    # meet the target around settled layers for the last 200 steps; evaluated with CoFi's expected-size mask and
    # exported as it where it fits (the recovery grid's gates_settled: the same run)
    Protocol.of_start("settle_300", "gates_settled"),
    # the same without encoder layer gates (NASH's split: the encoder narrowed, never dropped; the recovery grid's
    # gates_nash): at seed 1 settle_300 settled the whole encoder closed at both targets
    Protocol.of_start("nash_300", "gates_nash"),
    # the same with the decoder's depth given, two layers (pruning.settle_depth; the recovery grid's gates_depth2):
    # nash_300 settled one at every seed, and random structures keeping two scored higher at 0.67
    # (at 0.67 only: the recovery start's targets)
    Protocol.of_start("depth2_300", "gates_depth2"),
    # the decoder's first layers, decided after one gated step (pruning.settle_keep=bottom, Sajjad et al.'s top-layer
    # dropping), the gates choosing every width: every protocol above kept the top decoder layers (the recovery
    # grid's gates_bottom1 at 0.55, gates_bottom2 at 0.67)
    Protocol.of_start("bottom1_300", "gates_bottom1"),
    Protocol.of_start("bottom2_300", "gates_bottom2"),
    # bottom2_300 ended 4-5% under 0.67 at every seed (the multiplier went negative while the target ramped down to a
    # cost the settled layers were already below): the target without a ramp, or the layers decided at step 100
    Protocol.of_start("bottom2_flat_300", "gates_bottom2_flat"),
    Protocol.of_start("bottom2_late_300", "gates_bottom2_late"),
    Protocol.of_start("bottom1_late_300", "gates_bottom1_late"),
)


@dataclass(frozen=True)
class Cell:
    protocol: Protocol
    target: float
    seed: int
    setting: recovery.Setting = recovery.REAL

    @property
    def name(self) -> str:
        return f"{self.protocol.name}_{self.target}_s{self.seed}"

    @property
    def quick(self) -> bool:
        return self.setting is not recovery.REAL  # the smoke model (its base sets gated_steps too)

    @property
    def gated_steps(self) -> int:
        return max(4, round(self.protocol.gated_steps * 0.04)) if self.quick else self.protocol.gated_steps

    @property
    def settle(self) -> list[str]:
        at = self.protocol.settle_layers_at
        if at is None:
            return []
        return [f"pruning.settle_layers_at={max(1, round(at * self.gated_steps / self.protocol.gated_steps))}"]

    def args(self, runs: Path) -> list[str]:
        quick = self.quick
        base = [o for o in self.setting.base if not o.startswith("gated_steps=")]
        return ["pruning=speed", f"pruning.target_latency={self.target}", *base, f"gated_steps={self.gated_steps}",
                *self.protocol.overrides, *self.settle, f"trainer.log_every_n_steps={2 if quick else 10}", "finetune.steps=0", "export.formats=[hf]",
                "report.speed=false", f"seed={self.seed}", f"hydra.run.dir={runs / self.name}"]


def grid(setting: recovery.Setting = recovery.REAL) -> list[Cell]:
    targets = setting.targets[:1] if setting is not recovery.REAL else setting.targets  # quick: one target
    return [Cell(p, target, seed, setting) for target in targets for p in PROTOCOLS
            if setting is not recovery.REAL or p.recovery_start is None
            or target in recovery.candidate_targets(p.recovery_start, targets)
            for seed in (p.seeds if setting is recovery.REAL else SEEDS)]


def reused_run(cell: Cell, reuse: Path | None) -> Path | None:
    """The recovery grid's export of this very gated phase (its start ``recovery_start``) in ``reuse``, if it is
    there and finished; it was trained with the same overrides, logged at the trainer's default interval."""
    start = cell.protocol.recovery_start
    if reuse is None or start is None:
        return None
    run = reuse / recovery.Export(start, cell.target, cell.seed, cell.setting).name
    done = (run / "status.json").is_file() and json.loads((run / "status.json").read_text())["status"] == "done"
    return run if done and (run / "checkpoints" / "last.ckpt").is_file() else None


def _ran(run: Path) -> str:
    """The command a run was made with, from Hydra's record of its overrides (the run directory as RUNS)."""
    import yaml

    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    return "train.py " + " ".join(o if not o.startswith("hydra.run.dir=") else f"hydra.run.dir=RUNS/{run.name}"
                                  for o in overrides).replace(str(ROOT) + "/", "")


def run_cell(cell: Cell, runs: Path, results: Path, reuse: Path | None = None) -> dict:
    reused = reused_run(cell, reuse)
    run = reused or runs / cell.name
    args = [recovery._python(), str(ROOT / "train.py"), *cell.args(runs)]
    start = time.time()
    if reused is None:
        recovery._run(args, runs / f"{cell.name}.log")
    metrics = json.loads((run / "metrics.json").read_text())
    export = json.loads((run / "pruned" / "export_report.json").read_text())
    budget = metrics["budget"]["latency"]
    record = {
        "cell": cell.name, "protocol": cell.protocol.name, "target": cell.target, "seed": cell.seed,
        "gated_steps": cell.gated_steps,
        "command": _ran(reused) if reused else recovery._shown(args[1:], runs),
        "trajectory": trajectory(run),
        "expected_kept": budget["expected_kept"], "binary_kept": budget["binary_kept"],
        "plan_kept": budget["plan_kept"], "export_predicted": export["predicted"]["latency"],
        "decided_by_rule": export["decided_by_rule"],
        "gated": {"val_bleu": metrics["gated"]["bleu"], "kept": metrics["gated"]["kept"]},
        "export": {"val_bleu": metrics["bleu"], "kept": metrics["kept"]},
        "wall_s": metrics["seconds"]["run"] if reused else round(time.time() - start, 1),
        "reused": reused.name if reused else None,  # the recovery grid's run it was recorded from
        "machine": machine(),
    }
    record.update(final_gates(run, cell.target))
    _count_eval_mode(record, metrics)
    if not cell.quick:  # the suite's smoke cells are not scored on the embedded corpus
        record["masks_val_bleu"] = masks_bleu(run)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{cell.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _count_eval_mode(record: dict, metrics: dict) -> None:
    """What the gated model keeps in its eval mode, from its checkpoint's masks (a run made before metrics.json
    counted the eval mode's plan counted log_alpha > 0); a kind that was not gated keeps what the run counted."""
    mode = metrics["gated"].get("gate_mode", "binary")
    masks = {k: n for k, n in record["masks"].get(mode, record["masks"]["binary"]).items() if k != "total"}
    record["gated"]["kept"] = {**metrics["gated"]["kept"], **masks}


def final_gates(run: Path, target: float) -> dict:
    """From a cell's last checkpoint, priced by the latency fit its run used (``metrics.json`` ``costs``): each
    deterministic mask's latency (``CostBudget.report``: log_alpha > 0 and the expected size per kind, each with the
    plan's floor) and what it keeps, and the layer gates' log_alpha."""
    from gatedprune.costs.linear import LinearCost, StructureCosts
    from gatedprune.methods.budget import CostBudget
    from gatedprune.structures.head_gates import PLAN_MODES
    from gatedprune.structures.kinds import LAYER_KINDS
    from gatedprune.training.checkpoints import load_gated_checkpoint

    fit = json.loads((run / "metrics.json").read_text())["costs"]
    model, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
    gates.set_costs("latency", StructureCosts.of_linear(LinearCost("latency", fit["base"], fit["coefficients"]),
                                                        model, gates))
    report = CostBudget(gates, "latency", target, 0).report()["latency"]
    return {**{f"{rule}_kept": report[f"{rule}_kept"] for rule in PLAN_MODES},
            "masks": {rule: gates.alive(gates.plan(rule, note=False)) for rule in PLAN_MODES},
            "layer_log_alpha": {kind: [round(g.log_alpha.item(), 4) for g, k in zip(gates.gates, gates.kinds)
                                       if k == kind] for kind in LAYER_KINDS if kind in gates.kinds}}


def masks_bleu(run: Path) -> dict[str, float]:
    """Validation BLEU of the gated model in each plan mode, scored as the model its plan cuts (the same function:
    tests/test_plan_modes.py), by ``gatedprune-evaluate``'s scorer on the trainer's default data."""
    import shutil
    import tempfile

    from gatedprune.reports.evaluate import evaluate_dir
    from gatedprune.shipping.export_dir import save_pruned
    from gatedprune.structures.head_gates import PLAN_MODES
    from gatedprune.surgery.cut import prune_heads
    from gatedprune.training.checkpoints import load_gated_checkpoint

    scores = {}
    for rule in PLAN_MODES:
        model, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
        plan = gates.plan(rule, note=False)
        gates.remove()
        with tempfile.TemporaryDirectory(prefix="gates-") as work:
            save_pruned(prune_heads(model, plan), work)
            for file in (run / "tokenizer").iterdir():
                shutil.copy(file, work)
            scores[rule] = evaluate_dir(work, "validation", [], None, None)["bleu"]
    return scores


def rescore(results: Path, runs: Path, bleu: bool = False, reuse: Path | None = None) -> list[str]:
    """The final gates of every cell whose run is here (or, for a cell recorded from the recovery grid's run, in
    ``reuse``), into its json (cells measured before these fields); with ``bleu``, also each plan mode's validation
    BLEU (``masks_bleu``)."""
    done = []
    for r in records(results):
        run = reuse / r["reused"] if r.get("reused") and reuse is not None else runs / r["cell"]
        if not (run / "checkpoints" / "last.ckpt").is_file():
            continue
        r.update(final_gates(run, r["target"]))
        _count_eval_mode(r, json.loads((run / "metrics.json").read_text()))
        if bleu:
            r["masks_val_bleu"] = masks_bleu(run)
        (results / f"{r['cell']}.json").write_text(json.dumps(r, indent=2) + "\n")
        done.append(r["cell"])
    return done


def records(results: Path) -> list[dict]:
    """Every cell's json, by target, then in ``PROTOCOLS``' order, then seed."""
    order = [p.name for p in PROTOCOLS]
    found = [json.loads(p.read_text()) for p in results.glob("*.json")]
    return sorted(found, key=lambda r: (r["target"], order.index(r["protocol"]) if r["protocol"] in order
                                        else len(order), r["seed"]))


def _layers(kept: dict) -> str:
    """Encoder + decoder layers kept; a mask has no count for a stack whose layers were not gated (nash_300's
    encoder): it keeps them all."""
    return " + ".join(str(kept[kind]) if kind in kept else "all" for kind in ("encoder_layer", "decoder_layer"))


def table(results: Path) -> str:
    rows = []
    for r in records(results):
        layers = f"{_layers(r['gated']['kept'])} / {_layers(r['export']['kept'])}"
        size = r.get("expected_size_kept")
        masks = r.get("masks", {}).get("expected_size")
        bleu = r.get("masks_val_bleu")
        target = r["target"]
        rows.append([r["protocol"], target, r["seed"], r["gated_steps"], off_target(r["expected_kept"], target),
                     off_target(r["binary_kept"], target), off_target(size, target) if size is not None else "-",
                     off_target(r["plan_kept"], target),
                     f"{bleu['binary']:.2f} / {bleu['expected_size']:.2f} / {r['export']['val_bleu']:.2f}" if bleu
                     else f"{r['gated']['val_bleu']:.2f} / - / {r['export']['val_bleu']:.2f}", layers,
                     _layers(masks) if masks else "-",
                     ", ".join(f"{a:.2f}" for a in r.get("layer_log_alpha", {}).get("decoder_layer", [])) or "-",
                     r["decided_by_rule"]])
    return markdown_table(["protocol", "target", "seed", "gated steps", "expected kept", "log_alpha > 0",
                           "expected size", "export",
                           "val BLEU log_alpha > 0 / expected size / export", "layers enc + dec, gated / export",
                           "layers, expected size", "decoder layers' log_alpha", "decided unlike log_alpha > 0"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "rescore", "table", "quick"],
                        help="rescore: the final gates of the cells whose runs are here, into their jsons; quick: "
                             "every protocol on the smoke model, a few steps (the suite's check)")
    parser.add_argument("--runs", type=Path, default=Path("runs/gates"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--cell", default=None, help="one cell by name")
    parser.add_argument("--bleu", action="store_true", help="rescore: each plan mode's validation BLEU too")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="the recovery grid's runs (benchmarks/recovery.py --runs): a cell whose gated phase is "
                             "an export there is recorded from that run instead of trained again")
    args = parser.parse_args(argv)
    runs = args.runs.resolve()
    setting = recovery._quick(runs) if args.stage == "quick" else recovery.REAL
    if args.stage in ("run", "quick"):
        cells = [c for c in grid(setting) if args.cell in (None, c.name)]
        if args.cell and not cells:
            names = ", ".join(c.name for c in grid(setting))
            raise SystemExit(f"error: --cell {args.cell} is not a cell; allowed: {names}")
        for cell in cells:
            if (args.results / f"{cell.name}.json").is_file():
                print(f"{cell.name}: done (in {args.results})")
                continue
            run_cell(cell, runs, args.results, args.reuse.resolve() if args.reuse else None)
    if args.stage == "rescore":
        reuse = args.reuse.resolve() if args.reuse else None
        print("rescored: " + (", ".join(rescore(args.results, runs, args.bleu, reuse)) or "none (no run of a cell here)"))
    write_readme(args.results, "Gated phases against their latency target (benchmarks/gates.py)",
                 "Fractions of the dense model's predicted latency at the end of the gated phase, and how far off "
                 "the target; validation BLEU before any fine-tuning.", table(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
