"""The same plan every run (issue 38, item 3): the default's gated phase twice on one machine, the first while a second
process keeps one core busy, and how far apart their latency fits and the plans they ship are.

Each run is a default run's gated phase from the kept teacher (target 0.67, seed 1234), exported and not
fine-tuned, with the latency fit measured at set-up by each run (``fit=measured``: no table, a fresh cache of its
own, timed as a run timed it until 2026-12-07; ``measured_5pct``: the same, timed again until the fit misses its
probes by 5% at most), measured by the first run and kept for the second in the machine's cache
(``fit=measured_once``: no table, as a run without one priced from 2026-12-06; ``measured_once_5pct``: the same with
the fit timed to 5% before it is kept, as since 2026-12-07; ``$GATEDPRUNE_CACHE`` fresh for the pair), these on
the probes of one kind each, measured by each run on today's probes, which also shrink every kind at once
(``fit=measured_joint``), or read from the recovery grid's kept fit (``fit=table``). ``--protocol`` picks which
default: ``first_layers``, today's (``pruning=first_layers``, 300 gated steps), ``first_layers_late``, the one of
2026-12-06 (its layers settled at gated step 100, no widths held), or ``preset``, the one before both
(``pruning=speed``, 100 gated steps).
Its json records the fit (base, costs per structure, largest error over its probes, each probe's timings), the
plan and what the export scores before any recovery, or the line a run refused with; ``table`` compares each pair.
A run already in ``--results`` is skipped.

    .venv/bin/python benchmarks/plan_repro.py run --runs RUNS/repro       # busy then quiet, for each fit
    .venv/bin/python benchmarks/plan_repro.py recover --runs RUNS/repro --fit measured --load busy
                                          # that run's export, recovered as the grid's cell of the default's protocol
    .venv/bin/python benchmarks/plan_repro.py speed --runs RUNS/repro     # each export timed, and each fit's guess
    .venv/bin/python benchmarks/plan_repro.py table                       # docs/benchmarks/plan_repro/README.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery  # noqa: E402  (how a run is started, the teacher's kept latency fit)
from common import (FIT_UNTIL_2026_12_07, ONE_KIND_PROBES, ROOT, machine, trajectory,  # noqa: E402
                    workload_overrides, write_readme)

from gatedprune.utils import markdown_table  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "plan_repro"
# how each pair prices the teacher: a fit measured at set-up as a run made it until 2026-12-07 (timed again only
# beyond 20%, three timings at most, and kept for later runs at that; its records' commands, run then, name neither
# setting), one measured until it misses its probes by 5% at most (the median of up to 15 timings: docs/gates.md 0c),
# the same kept for later runs (``measured_once_5pct``: a run with no table since 2026-12-07), those two on probes
# that each shrink one kind; a fit of today's default, also timed on probes that shrink every kind at once, each run
# its own (``measured_joint``; docs/gates.md 0c), or the kept table
UNTIL_2026_12_07 = workload_overrides(FIT_UNTIL_2026_12_07)
ONE_KIND = workload_overrides(ONE_KIND_PROBES)
FITS = {"measured": ["pruning.workload.table=null", *UNTIL_2026_12_07],
        "measured_5pct": ["pruning.workload.table=null", "pruning.workload.fit_tolerance=0.05",
                          "pruning.workload.fit_attempts=15", *ONE_KIND],
        "measured_once": ["pruning.workload.table=null", *UNTIL_2026_12_07],
        "measured_once_5pct": ["pruning.workload.table=null", "pruning.workload.keep_tolerance=0.05",
                               "pruning.workload.fit_attempts=15", *ONE_KIND],
        "measured_joint": ["pruning.workload.table=null"],
        "table": [f"pruning.workload.table={recovery.TABLE}"]}
# whose machine cache of latency fits (costs.table.machine_dir) a run sees: its own, empty (it times its fit), or
# one the pair shares, empty before its first run (the first times the fit, the second reuses it)
SHARED_CACHE = {"measured_once", "measured_once_5pct"}
LOADS = ("busy", "quiet")  # in this order: the busy run first, as the issue asks
# each default's gated phase, and the prefix of its records' names (the preset's were recorded without one):
# today's (pruning=first_layers since 2026-12-07: the layers settled at step 1, the widths held from step 200), the
# one of 2026-12-06 (the same preset with its layers settled at step 100 and no widths held), and the one before both
PROTOCOLS = {"first_layers": ("first_layers_widths_", ["model=teacher", "gated_steps=300"]),
             "first_layers_late": ("first_layers_", ["model=teacher", "gated_steps=300", *recovery.FIRST_LAYERS_LATE]),
             "preset": ("", ["pruning=speed", "model=teacher", "gated_steps=100"])}


# the recovery the grid gave today's default's protocol at this seed (docs/gates.md 0n), given to a pair's export by
# ``recover``: does a plan that a measured fit priced recover as far as the kept table's did?
RECOVERED_AS = "choose_gates_bottom2_widths_0.67_s1234_1000_lr0.002"


def name_of(protocol: str, fit: str, load: str) -> str:
    return f"{PROTOCOLS[protocol][0]}{fit}_{load}"


def args(fit: str, load: str, runs: Path, protocol: str = "first_layers") -> list[str]:
    # first_layers prices the teacher by the kept table unless told not to; the preset measures unless given it
    return [*PROTOCOLS[protocol][1], *FITS[fit], "finetune.steps=0", "export.formats=[hf]", "report.speed=false",
            "seed=1234", f"hydra.run.dir={runs / name_of(protocol, fit, load)}"]


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
    """Every site's kept structures in one mapping, from an export report: heads (``plan``: kind -> site -> heads),
    FFN units (``plan_units``: kind -> site -> units) and layers (``plan_layers``: stack -> layers)."""
    return {**{f"heads {site}": kept for sites in report["plan"].values() for site, kept in sites.items()},
            **{f"units {site}": kept for sites in report["plan_units"].values() for site, kept in sites.items()},
            **{f"layers {stack}": kept for stack, kept in report["plan_layers"].items()}}


def plan_difference(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    """Structures kept by one plan and not the other, over every site either names."""
    return sum(len(set(a.get(site, [])) ^ set(b.get(site, []))) for site in set(a) | set(b))


def machine_cache(fit: str, load: str, runs: Path, protocol: str) -> Path:
    """The machine cache of latency fits a run sees (``GATEDPRUNE_CACHE``), emptied where its pair starts afresh."""
    shared = fit in SHARED_CACHE
    path = runs / "caches" / (f"{PROTOCOLS[protocol][0]}{fit}" if shared else name_of(protocol, fit, load))
    if not shared or load == LOADS[0]:
        shutil.rmtree(path, ignore_errors=True)
    return path


def bleu_of(metrics: dict) -> dict[str, float]:
    """What the plan scores as exported, before any recovery: validation and test BLEU of a run's ``metrics.json``."""
    return {"validation": metrics["bleu"], "test": metrics["test"]["pruned"]["bleu"]}


def run_one(fit: str, load: str, runs: Path, results: Path, protocol: str = "first_layers") -> dict:
    name = name_of(protocol, fit, load)
    command = [recovery._python(), str(ROOT / "train.py"), *args(fit, load, runs, protocol)]
    start = time.time()
    results.mkdir(parents=True, exist_ok=True)
    cache = machine_cache(fit, load, runs, protocol)
    said = {"name": name, "protocol": protocol, "fit": fit, "load": load,
            "command": f"GATEDPRUNE_CACHE={recovery._shown([str(cache)], runs)} "
                       f"{recovery._shown(command[1:], runs)}"}
    with busy_core(load == "busy"):
        try:
            recovery._run(command, runs / f"{name}.log", env={"GATEDPRUNE_CACHE": str(cache)})
        except subprocess.CalledProcessError:  # a refusal (a fit that misses its probes, a depth too deep) is a result
            lines = (runs / f"{name}.log").read_text().splitlines()
            refused = next((line for line in reversed(lines) if line.startswith("error: ")), None)
            if refused is None:  # a crash, not a one-line refusal: no record, so the next run tries again
                raise
            record = {**said, "refused": refused, "wall_s": round(time.time() - start, 1), "machine": machine()}
            (results / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
            return record
    run = runs / name
    metrics = json.loads((run / "metrics.json").read_text())
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    costs = metrics["costs"]
    probes = []
    if costs.get("path"):
        probes = json.loads(Path(costs["path"]).read_text()).get("probes", [])
    costs = {**costs, "path": recovery._shown([costs["path"]], runs) if costs.get("path") else None}
    record = {**said, "costs": {k: costs.get(k) for k in ("source", "fit_error", "base", "coefficients", "path")},
              "probes": [{k: p.get(k) for k in ("probe", "seconds", "timings", "predicted")} for p in probes],
              "plan": plan_of(report), "kept": metrics["kept"], "predicted": report["predicted"],
              "bleu": bleu_of(metrics),
              "budget": metrics.get("budget"),  # the expected cost at the end and the export's
              "trajectory": trajectory(run),
              "wall_s": round(time.time() - start, 1), "machine": machine()}
    (results / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def recovery_args(name: str, runs: Path) -> list[str]:
    """``gatedprune-finetune``'s arguments for the export of run ``name``: the grid cell ``RECOVERED_AS``'s, its model
    and output folder replaced."""
    cell = next(c for c in recovery._grid() if c.name == RECOVERED_AS)
    args = cell.args(runs)
    out = args.index("--out")
    return [str(runs / name / "pruned"), *args[1:out + 1], str(runs / f"{name}_recovered"), *args[out + 2:]]


def recover_one(name: str, runs: Path, results: Path) -> dict:
    """Recover the export of the run recorded as ``name`` as the grid recovered ``RECOVERED_AS``; its record gains
    ``recovered`` (the command, the step shipped and its test BLEU)."""
    path = results / f"{name}.json"
    record = json.loads(path.read_text())
    args = recovery_args(name, runs)
    run = runs / f"{name}_recovered"
    if not (run / "metrics.json").is_file():
        recovery._run([recovery._python(), "-m", "gatedprune", "finetune", *args], runs / f"{name}_recovered.log")
    metrics = json.loads((run / "metrics.json").read_text())
    tuned = metrics["finetune"]
    record["recovered"] = {"as": RECOVERED_AS, "command": recovery._shown(["gatedprune-finetune", *args], runs),
                           "shipped_step": tuned["shipped_step"], "test_bleu": metrics["test"]["pruned"]["bleu"],
                           "wall_s": tuned["wall_s"]}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record


SPEED_REPEATS = 15  # interleaved calls per model (median): this machine's calls move 10-15% each (docs/gates.md 0c)


def speed(results: Path, runs: Path, load_teacher, timer=None, repeats: int = SPEED_REPEATS,
          protocol: str = "first_layers", name: str | None = None) -> dict:
    """Which fit predicts this machine? Every recorded run of ``protocol`` whose export is still in ``runs``, the
    teacher and a copy of it (the noise floor), timed in one process as the latency fit times its probes (the
    default workload's ``generate()``, CPU time, one thread; ``timer``: the fit's, default ``torch_timer``), in turn,
    the median of ``repeats`` calls each. Beside each measured speed-up (the teacher's time over the export's), the one
    its own fit predicted (the run's record) and the one the kept table predicts. Written to
    ``name`` (default ``speed_<protocol>.json``: a repeat gets a name of its own) in ``results``. Each plan is timed once, and each pair has a row per plan (one where its
    two runs ship the same), priced by that row's own fit."""
    from gatedprune.costs import table as latency_table
    from gatedprune.costs.timers import torch_timer
    from gatedprune.costs.workload import Workload
    from gatedprune.surgery.model_loading import load_seq2seq

    workload = Workload(repeats=repeats)
    _, kept_fit, _ = latency_table.read(recovery.TABLE)
    found = []  # each pair's records, one per plan it ships (a refused run has none)
    for fit in FITS:
        pair = []
        for load in LOADS:
            path = results / f"{name_of(protocol, fit, load)}.json"
            record = json.loads(path.read_text()) if path.is_file() else {}
            if "plan" in record and all(r["plan"] != record["plan"] for r in pair):
                pair.append(record)
        found += pair
    timed = []  # (name, plan): one export per plan, the same plan being the same model to time
    for record in found:
        if all(plan != record["plan"] for _, plan in timed) and (runs / record["name"] / "pruned").is_dir():
            timed.append((record["name"], record["plan"]))
    shown = [(record, i) for record in found for i, (_, plan) in enumerate(timed) if plan == record["plan"]]
    if not timed:
        raise SystemExit(f"speed: no export of a recorded {protocol} run in {runs}")
    teacher = load_teacher().float().eval()
    models = [teacher, load_teacher().float().eval(),
              *(load_seq2seq(runs / name / "pruned").float().eval() for name, _ in timed)]
    print(f"timing the teacher, a copy of it and {len(timed)} exports in turn, {repeats} calls each")
    seconds = (timer or torch_timer)(models, workload)
    rows = [{"name": record["name"], "fit": record["fit"], "fit_error": record["costs"]["fit_error"],
             "measured": seconds[0] / seconds[2 + i], "own_fit": record["predicted"]["speed_up"],
             "kept_table": kept_fit.of(teacher) / kept_fit.of(models[2 + i])} for record, i in shown]
    out = {"protocol": protocol, "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workload": workload.decoding(), "noise_floor": seconds[0] / seconds[1], "teacher_s": seconds[0],
           "rows": rows, "command": f".venv/bin/python benchmarks/plan_repro.py speed --runs RUNS/repro "
                                    f"--protocol {protocol}" + (f" --name {name}" if name else "")}
    (results / (name or f"speed_{protocol}.json")).write_text(json.dumps(out, indent=2) + "\n")
    return out


def speed_table(record: dict) -> str:
    """The speed stage's rows: measured against each prediction, and how far off each is."""
    def off(predicted: float, measured: float) -> str:
        return f"{predicted:.2f}x ({100 * (predicted / measured - 1):+.0f}%)"

    rows = [[r["name"], f"{r['fit_error']:.1%}", f"{r['measured']:.2f}x", off(r["own_fit"], r["measured"]),
             off(r["kept_table"], r["measured"])] for r in record["rows"]]
    rows.append(["a copy of the teacher (noise floor)", "-", f"{record['noise_floor']:.2f}x", "1.00x", "1.00x"])
    return markdown_table(["run's export", "its fit's error", "measured speed-up", "its own fit predicted (off)",
                           "the kept table predicts (off)"], rows)


def table(results: Path) -> str:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    rows = []

    def coefficient(c: dict, kind: str, scale: float) -> str:  # a kind the protocol does not gate has no price
        return f"{scale * c['coefficients'][kind]:.2f}" if kind in c["coefficients"] else "-"

    for protocol in PROTOCOLS:
        for fit in FITS:
            pair = [found.get(name_of(protocol, fit, load)) for load in LOADS]
            complete = None not in pair and not any("refused" in r for r in pair)
            for r in pair:
                if r is None:
                    continue
                if "refused" in r:
                    rows.append([protocol, fit, r["load"], *["-"] * 10, f"refused: {r['refused']}"])
                    continue
                c = r["costs"]
                rows.append([protocol, fit, r["load"], c["source"],
                             f"{c['fit_error']:.1%}" if c["fit_error"] is not None else "-",
                             f"{1000 * c['base']:.1f}", coefficient(c, "decoder_layer", 1000),
                             coefficient(c, "encoder_layer", 1000), coefficient(c, "decoder_ffn", 1e6),
                             f"{r['predicted']['latency']:.3f}",
                             f"{r['kept'].get('encoder_layer', 'all')} + {r['kept']['decoder_layer']}",
                             f"{r['bleu']['validation']:.2f}" if "bleu" in r else "-",  # recorded since 2026-12-07
                             f"{r['recovered']['test_bleu']:.2f}" if "recovered" in r else "-",
                             plan_difference(pair[0]["plan"], pair[1]["plan"]) if complete else "-"])
    return markdown_table(["protocol", "fit", "load", "fit from", "fit error", "base ms", "decoder layer ms",
                           "encoder layer ms",
                           "decoder FFN unit us", "export latency kept", "layers enc + dec",
                           "validation BLEU as exported",
                           f"test BLEU recovered as {RECOVERED_AS}",
                           "structures the two plans differ in"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "recover", "speed", "table"],
                        help="recover: one recorded run's export (--fit, --load) recovered as the grid's cell "
                             f"{RECOVERED_AS}")
    parser.add_argument("--runs", type=Path, default=Path("runs/repro"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--fit", choices=list(FITS), default=None, help="one pair (default: each)")
    parser.add_argument("--load", choices=list(LOADS), default=None, help="recover: which run of the pair")
    parser.add_argument("--name", default=None,
                        help="speed: the record's file name (default speed_<protocol>.json; a repeat's own)")
    parser.add_argument("--protocol", choices=list(PROTOCOLS), default="first_layers",
                        help="today's default run's (first_layers), the one of 2026-12-06 (first_layers_late) or the one "
                             "before both (preset)")
    args_ = parser.parse_args(argv)
    if args_.name is not None and not (args_.stage == "speed" and args_.name.startswith("speed_")
                                       and args_.name.endswith(".json") and "/" not in args_.name):
        parser.error(f"--name {args_.name}; allowed: with the speed stage, a file name speed_*.json")
    if args_.stage == "recover":
        if not (args_.fit and args_.load):
            parser.error("recover takes one run: --fit and --load")
        name = name_of(args_.protocol, args_.fit, args_.load)
        if not (args_.results / f"{name}.json").is_file():
            parser.error(f"recover: no record {args_.results / (name + '.json')}; allowed: a run of the run stage")
        if "recovered" in json.loads((args_.results / f"{name}.json").read_text()):
            print(f"{name}: recovered (in {args_.results})")
        else:
            recover_one(name, args_.runs.resolve(), args_.results)
    if args_.stage == "speed":
        speed(args_.results, args_.runs.resolve(), recovery._kept_teacher()[0], protocol=args_.protocol,
              name=args_.name)
    if args_.stage == "run":
        for fit in [args_.fit] if args_.fit else FITS:
            for load in LOADS:
                name = name_of(args_.protocol, fit, load)
                if (args_.results / f"{name}.json").is_file():
                    print(f"{name}: done (in {args_.results})")
                    continue
                run_one(fit, load, args_.runs.resolve(), args_.results, args_.protocol)
    write_readme(args_.results, "The same plan every run (benchmarks/plan_repro.py)",
                 "A default run's gated phase from the teacher (target 0.67, seed 1234), twice per fit: first with a "
                 "second process spinning on one core, then without; the fit's costs, and how many structures the two "
                 "exports' plans differ in. first_layers: today's default (pruning=first_layers, 300 gated steps, the "
                 "layers settled at step 1 and the widths held from step 200, since 2026-12-07); first_layers_late: "
                 "the default of 2026-12-06 (the layers settled at step 100, no widths held); preset: the default "
                 "before both (pruning=speed, 100 gated steps). Fits: measured at set-up as a run "
                 "made it until 2026-12-07 (timed again beyond 20%, three timings at most), each run its own "
                 "(measured), measured until it misses its probes by 5% at most "
                 "(measured_5pct: pruning.workload.fit_tolerance=0.05, fit_attempts=15), measured by the busy run "
                 "and kept in the machine's cache for the quiet one (measured_once: a run with no table from "
                 "2026-12-06; measured_once_5pct: the same timed to 5% before it is kept, since 2026-12-07), these "
                 "on the probes of one kind each, or each run its own on today's probes, which also shrink every kind "
                 "at once (measured_joint, since the evening of 2026-12-07), or the kept table (table).",
                 table(args_.results) + "".join(
                     f"\n\n{path.name} ({r['when']}, {r['machine']}: `{r['command']}`): each export timed as the "
                     "latency fit times its probes, beside the teacher, the median of "
                     f"{r['workload']['repeats']} interleaved calls\n\n" + speed_table(r)
                     for path in sorted(args_.results.glob("speed_*.json"))
                     for r in [json.loads(path.read_text())]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
