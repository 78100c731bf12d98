"""How well the latency fit predicts the time of pruned models it was not fitted on (gatedprune.costs.latency).

For each model (random weights: benchmarks/common.py) and batch size, the fit is made as a run makes it (the dense
model, each kind shrunk to 50% and 0%, and every kind at once to each, CPU time, one thread), then pruned models of
every kind and mixtures of them, drawn at random, are timed against the dense model in one process (CPU time,
alternating) and compared with the prediction: the error of the predicted time against the measured one, and of the
predicted speed-up.

    .venv/bin/python benchmarks/cost_model.py [--quick] [--models default transformer-base] [--batches 1 32]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, when run as a script or loaded by a test
from common import MODELS, ROOT, command_line, machine, versions  # noqa: E402

from gatedprune.costs.flops import flops_cost  # noqa: E402
from gatedprune.costs.counts import features  # noqa: E402
from gatedprune.costs.latency import fit, probe_models  # noqa: E402
from gatedprune.costs.linear import LinearCost  # noqa: E402
from gatedprune.costs.timers import torch_timer  # noqa: E402
from gatedprune.costs.workload import Workload  # noqa: E402
from gatedprune.structures.adapters import probe  # noqa: E402
from gatedprune.structures.kinds import ATTENTION_KINDS, FFN_KINDS  # noqa: E402
from gatedprune.structures.sites import structure_sites  # noqa: E402
from gatedprune.surgery.cut import prune_heads  # noqa: E402
from gatedprune.utils import atomic_write_text, format_table, markdown_table  # noqa: E402


def _keep(rng: random.Random, count: int, fraction: float) -> list[int]:
    return sorted(rng.sample(range(count), round(fraction * count)))


def validation_plans(model, seed: int = 0) -> list[tuple[str, dict]]:
    """Plans the fit never saw: random heads, random units, other depths, and mixtures with uneven layers."""
    rng = random.Random(seed)
    heads = structure_sites(model, ATTENTION_KINDS)
    units = structure_sites(model, FFN_KINDS)
    layers = probe(model).layers
    depth = {stack: len(model.get_submodule(path)) for stack, path in layers.items()}

    def sites(chosen, fraction=None):
        return {s.path: _keep(rng, s.num_units, fraction if fraction is not None else rng.uniform(0.1, 0.9))
                for s in chosen}

    def spaced(stack, keep):
        total = depth[stack]
        return {layers[stack]: sorted({round(i * (total - 1) / max(keep - 1, 1)) for i in range(keep)})}

    return [
        ("heads 40% (random)", sites(heads, 0.4)),
        ("FFN 30% (random)", sites(units, 0.3)),
        ("decoder layers 1/3", spaced("decoder", max(1, depth["decoder"] // 3))),
        ("encoder layers 1/2", spaced("encoder", depth["encoder"] // 2)),
        ("mixed: heads, FFN uneven", {**sites(heads), **sites(units)}),
        ("mixed: all kinds", {**sites(heads), **sites(units), **spaced("decoder", max(1, depth["decoder"] // 2)),
                              **spaced("encoder", max(1, 2 * depth["encoder"] // 3))}),
    ]


def bench(name: str, batch: int, quick: bool, log) -> dict:
    torch.manual_seed(0)
    model = MODELS[name](vocab_size=512) if quick else MODELS[name]()
    workload = Workload(source_tokens=8 if quick else 32, target_tokens=4 if quick else 32, batch=batch,
                        repeats=1 if quick else 5, threads=1)
    plans = validation_plans(model)
    probes = probe_models(model, workload.probe_fractions, workload.joint_probes)
    pruned = [prune_heads(copy.deepcopy(model), plan) for _, plan in plans]
    # the probes and the models to predict timed in one alternating session: the machine's load drifts over minutes,
    # and a fit measured under one load would be judged against timings made under another
    log(f"{name}, batch {batch}: timing {len(probes)} probes and {len(plans)} pruned models in turn")
    seconds = torch_timer([m for _, m in probes] + pruned, workload)
    base, coefficients = fit([features(m) for _, m in probes], seconds[:len(probes)])
    cost = LinearCost("latency", base, coefficients)
    probe_rows = [{"probe": n, "seconds": t, "predicted": cost.of(m)} for (n, m), t in zip(probes, seconds)]
    measured = [seconds[0], *seconds[len(probes):]]  # the dense model is the first probe
    flops = flops_cost(model, workload)
    dense_pred, dense_flops = cost.of(model), flops.of(model)
    rows = []
    for (plan_name, _), m, seconds in zip(plans, pruned, measured[1:]):
        predicted = cost.of(m)
        rows.append({"plan": plan_name, "measured_s": seconds, "predicted_s": predicted,
                     "time_error": predicted / seconds - 1, "measured_speed_up": measured[0] / seconds,
                     "predicted_speed_up": dense_pred / predicted, "flops_speed_up": dense_flops / flops.of(m)})
        rows[-1]["speed_up_error"] = rows[-1]["predicted_speed_up"] / rows[-1]["measured_speed_up"] - 1
    return {"model": name, "batch": batch, "workload": workload.decoding(), "base": cost.base,
            "coefficients": cost.coefficients, "dense": {"measured_s": measured[0], "predicted_s": dense_pred},
            "probes": probe_rows, "plans": rows}


def report(results: list[dict], command: str) -> str:
    lines = [
        "# Latency fit: predicted against measured CPU time",
        "",
        f"`{command}` on {machine()}; {versions()}; {datetime.date.today()}.",
        "",
        "The fit (gatedprune.costs.latency) times the dense model, 14 copies with one kind shrunk to 50% or 0% and",
        "2 with every kind shrunk to 50% or 0% at once (until 2026-12-07: the 14 alone), and solves for a cost per",
        "structure. The pruned models below were not among them: random heads and units, other depths, mixtures with",
        "uneven layers. Probes and pruned models are timed in turn in one session (CPU time, one thread, greedy",
        "generate(), exactly 32 new tokens from 32 source tokens, median of 5), the fit made from the probes' times",
        "alone. `time error` is the predicted time over the measured one, less 1 (the issue's target: within 15%);",
        "`error` beside the speed-ups compares the predicted speed-up with the measured one.",
        "",
    ]
    header = ["model", "batch", "plan", "measured ms", "predicted ms", "time error", "speed-up measured",
              "predicted", "error", "by FLOPs"]
    rows = []
    for r in results:
        rows.append([r["model"], r["batch"], "dense", f"{1000 * r['dense']['measured_s']:.1f}",
                     f"{1000 * r['dense']['predicted_s']:.1f}",
                     f"{r['dense']['predicted_s'] / r['dense']['measured_s'] - 1:+.1%}", "1", "1", "", "1"])
        for p in r["plans"]:
            rows.append([r["model"], r["batch"], p["plan"], f"{1000 * p['measured_s']:.1f}",
                         f"{1000 * p['predicted_s']:.1f}", f"{p['time_error']:+.1%}", f"{p['measured_speed_up']:.2f}",
                         f"{p['predicted_speed_up']:.2f}", f"{p['speed_up_error']:+.1%}",
                         f"{p['flops_speed_up']:.2f}"])
    worst = max(abs(p["time_error"]) for r in results for p in r["plans"])
    worst_ratio = max(abs(p["speed_up_error"]) for r in results for p in r["plans"])
    within = sum(abs(p["time_error"]) <= 0.15 for r in results for p in r["plans"])
    total = sum(len(r["plans"]) for r in results)
    lines += [markdown_table(header, rows), "", f"Largest time error over the pruned models: {worst:.1%} ({within} of "
              f"{total} within 15%); largest speed-up error: {worst_ratio:.1%}.", "",
              "Fitted milliseconds per structure (base: per call):", ""]
    kinds = list(results[0]["coefficients"])
    lines.append(markdown_table(["model", "batch", "base", *kinds], [
        [r["model"], r["batch"], f"{1000 * r['base']:.2f}", *(f"{1000 * r['coefficients'][k]:.4f}" for k in kinds)]
        for r in results]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (the test suite's)")
    parser.add_argument("--models", nargs="+", default=["default", "transformer-base"], choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args(argv)
    models = ["default"] if args.quick else args.models
    batches = [2] if args.quick else args.batches
    results = [bench(name, batch, args.quick, lambda s: print(s, file=sys.stderr)) for name in models for batch in batches]
    command = command_line("cost_model.py", argv if argv is not None else sys.argv[1:])
    text = report(results, command)
    print(format_table(["model", "batch", "plan", "time error"],
                       [[r["model"], r["batch"], p["plan"], f"{p['time_error']:+.1%}"] for r in results for p in r["plans"]]))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "cost_model.md", text)
    atomic_write_text(args.out / "cost_model.json", json.dumps({"command": command, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
