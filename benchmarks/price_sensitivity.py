"""How precise a latency fit must be for two runs to ship one plan, and how precise one timed in a run is (issue 38,
item 3).

Two default runs priced by one fit ship one plan (docs/gates.md 0c: the kept table, 0 structures apart); two that each
time their own ship plans thousands apart. This script measures the two sides of that:

- **What the plan can bear.** ``run`` repeats the pair's gated phase (``plan_repro.py``'s ``first_layers`` protocol,
  seed 1234, the export not fine-tuned) with the kept table's price of one kind (or its base) moved by 0.1%, 1% or
  10% (``NUDGES``; the first moves nothing, the control), and counts the structures its plan keeps apart from the
  kept table's own run (``first_layers_widths_table_quiet``). Each nudged table is written under ``--runs``; no timing is made, so the
  load of the machine does not enter.
- **What a run's timings give.** ``table`` resamples the timings ``fit_spread.py`` recorded (the 17 probes timed 15
  times, busy and quiet; docs/benchmarks/fit_spread/joint/) with replacement, ``DRAWS`` times, and fits each
  resample's per-probe median as a run fits it (``latency.fit``): the 5th-95th percentile of each kind's share of the
  dense latency, and of the speed-up each fit predicts for the plans ``plan_repro.py speed`` timed. That interval
  narrows about as 1 / sqrt(timings), which prices how many timings a run would need.

    .venv/bin/python benchmarks/price_sensitivity.py run --runs RUNS/sensitivity     # the nudges not yet recorded
    .venv/bin/python benchmarks/price_sensitivity.py table     # docs/benchmarks/price_sensitivity/README.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_spread  # noqa: E402  (the recorded timings, shares and predicted speed-ups)
import plan_repro  # noqa: E402  (the default's gated phase, its plan and how far two plans are apart)
import recovery  # noqa: E402  (how a run is started, the kept table)
from common import ROOT, machine, write_readme  # noqa: E402

from gatedprune.costs.latency import fit  # noqa: E402
from gatedprune.costs.linear import LinearCost  # noqa: E402
from gatedprune.costs.workload import Workload  # noqa: E402
from gatedprune.structures.kinds import ALL_KINDS  # noqa: E402
from gatedprune.utils import atomic_write_text, markdown_table  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "price_sensitivity"
REFERENCE = "first_layers_widths_table_quiet"  # the kept table's own run of the pair (plan_repro's records)
# (what is priced higher, by how much): the kinds the default's widths are traded between, and the base, which sets
# what the target means; one nudge ten times smaller and one ten times larger, to see how the plan's move scales with
# the price's (the pairs' independent fits disagreed by tens of per cent). The first moves
# nothing: the control, that today's code given the kept table ships the reference's plan
NUDGES = (("base", 1.0), ("decoder_ffn", 1.01), ("cross", 1.01), ("decoder", 1.01), ("encoder_ffn", 1.01),
          ("base", 1.01), ("decoder_ffn", 1.001), ("decoder_ffn", 1.1))
DRAWS = 400  # bootstrap resamples per record (seeded: the page is made again in the tests)
SPREAD = (5, 95)  # the percentiles shown
SHOWN, NUDGE = "decoder_ffn", 0.01  # the largest width kind's price, and the move the nudges make


def name_of(kind: str, factor: float) -> str:
    return f"{kind}_x{factor:g}"


def nudged(kind: str, factor: float, path: Path) -> Path:
    """A copy of the kept table with ``kind``'s price (or the base) multiplied by ``factor``, written to ``path``."""
    data = json.loads(recovery.TABLE.read_text())
    if kind == "base":
        data["base"] *= factor
    else:
        data["coefficients"][kind] *= factor
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


def run_one(kind: str, factor: float, runs: Path, results: Path) -> dict:
    """The default's gated phase priced by the kept table with one price nudged; its plan against the reference's."""
    name = name_of(kind, factor)
    table = nudged(kind, factor, runs / "tables" / f"{name}.json")
    args = [a for a in plan_repro.args("table", "quiet", runs) if not a.startswith(("pruning.workload.table=",
                                                                                    "hydra.run.dir="))]
    command = [recovery._python(), str(ROOT / "train.py"), *args, f"pruning.workload.table={table}",
               f"hydra.run.dir={runs / name}"]
    start = time.time()
    cache = runs / "caches" / name  # a table is read, never cached; a fresh folder keeps the machine's out of it
    recovery._run(command, runs / f"{name}.log", env={"GATEDPRUNE_CACHE": str(cache)})
    metrics = json.loads((runs / name / "metrics.json").read_text())
    report = json.loads((runs / name / "pruned" / "export_report.json").read_text())
    reference = json.loads((plan_repro.RESULTS / f"{REFERENCE}.json").read_text())
    plan = plan_repro.plan_of(report)
    record = {"name": name, "kind": kind, "factor": factor, "command": recovery._shown(command[1:], runs),
              "plan": plan, "kept": metrics["kept"], "reference": REFERENCE, "reference_kept": reference["kept"],
              "apart": plan_repro.plan_difference(plan, reference["plan"]),
              "wall_s": round(time.time() - start, 1), "machine": machine()}
    results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(results / f"{name}.json", json.dumps(record, indent=2) + "\n")
    return record


def bootstrap(record: dict, plans: dict, draws: int = DRAWS, seed: int = 0) -> dict:
    """Fits to ``draws`` resamples (with replacement) of a ``fit_spread`` record's timings: per kind (and the base)
    its share of the dense latency, and per plan the speed-up predicted, each as (pooled fit, low, high) over the
    ``SPREAD`` percentiles; ``width``: per plan, (high - low) / the pooled fit's speed-up."""
    rows = [p["structures"] for p in record["probes"]]
    dense, timings = rows[0], np.asarray(record["timings"])  # (N, J): N timings of J probes
    rng = np.random.default_rng(seed)

    def fitted(sample: np.ndarray) -> tuple[dict, list[float]]:
        cost = LinearCost("latency", *fit(rows, np.median(sample, axis=0).tolist()))
        shares = fit_spread.shares(cost, dense)
        return shares, [fit_spread.speed_up(shares, dense, kept) for kept, _ in plans.values()]

    pooled_shares, pooled_speed = fitted(timings)
    drawn = [fitted(timings[rng.integers(0, len(timings), len(timings))]) for _ in range(draws)]
    share = {k: (pooled_shares[k], *np.percentile([d[0][k] for d in drawn], SPREAD)) for k in ("base", *ALL_KINDS)}
    speed = np.asarray([d[1] for d in drawn])  # (draws, plans)
    low, high = np.percentile(speed, SPREAD, axis=0)
    return {"timings": len(timings), "shares": share,
            "speed": {name: (pooled_speed[i], low[i], high[i]) for i, name in enumerate(plans)},
            "width": [(high[i] - low[i]) / pooled_speed[i] for i in range(len(plans))]}


def timings_for(half_width: float, timings: int, wanted: float) -> int:
    """How many timings narrow an interval's half-width from ``half_width`` (over ``timings`` of them) to ``wanted``,
    the interval shrinking as 1 / sqrt(n)."""
    return int(np.ceil(timings * (half_width / wanted) ** 2 - 1e-9))  # - 1e-9: 15 * 28.0**2 is 11760, not above


def seconds_per_timing(record: dict) -> float:
    """CPU seconds one timing of every probe takes: the calls per probe times the sum of the probes' median times
    (the warm-up calls left out: a lower bound)."""
    return record["workload"]["repeats"] * float(np.sum(np.median(np.asarray(record["timings"]), axis=0)))


def nudge_table(results: Path) -> str:
    rows = []
    for kind, factor in NUDGES:
        path = results / f"{name_of(kind, factor)}.json"
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        kept = r["kept"]
        moved = "none (the kept table as it is)" if factor == 1 else f"{kind} x {factor:g} ({100 * (factor - 1):+.1f}%)"
        rows.append([moved, str(r["apart"]),
                     ", ".join(f"{k} {kept[k]}" for k in ALL_KINDS if k in kept)])
    return markdown_table(["price moved", "structures apart from the kept table's plan", "what the plan keeps"], rows)


def precision_table(spread_dir: Path = fit_spread.RESULTS / "joint", plans: dict | None = None) -> tuple[str, list]:
    """Per load: each kind's share, pooled [5th-95th percentile over resamples], and the plans' predicted speed-up
    interval (its width over the pooled prediction, the median over the plans)."""
    plans = plans if plans is not None else fit_spread.measured_plans()
    rows, found = [], []
    for load in fit_spread.LOADS:
        record = json.loads((spread_dir / f"{load}.json").read_text())
        b = bootstrap(record, plans)
        share, low, high = b["shares"][SHOWN]
        half = (high - low) / 2 / share  # the price's 90% half-width, relative to it
        needed = timings_for(half, b["timings"], NUDGE)
        found.append((load, b, half, needed))
        rows.append([load, str(b["timings"]),
                     *(f"{100 * s:.1f} [{100 * lo:.1f}-{100 * hi:.1f}]" for s, lo, hi in
                       (b["shares"][k] for k in ("base", *ALL_KINDS))),
                     f"{100 * np.median(b['width']):.1f}%", f"±{100 * half:.0f}%",
                     f"{needed:,} ({needed * seconds_per_timing(record) / 3600:.0f} h)"])
    return markdown_table(["load", "timings", "base %", *(f"{k} %" for k in ALL_KINDS),
                           "a plan's predicted speed-up, 90% interval width (median over plans)",
                           f"{SHOWN}'s price, 90% half-width", f"timings for ±{NUDGE:.0%} on it (CPU time)"],
                          rows), found


INTRO = ("The kept table prices the default's gated phase (`plan_repro.py`'s `first_layers` protocol, seed 1234, "
         "not fine-tuned); each row moves one of its prices by the factor shown and counts the structures (heads, "
         "FFN units, layers) the plan keeps apart from the kept table's own run (`{reference}`, docs/benchmarks/"
         "plan_repro/). No timing is made: the gated phase is the same computation but for that price.")
PRECISION = ("What a run's timings give: `fit_spread.py`'s records (the 17 probes of the kept teacher timed 15 "
             "times, busy and quiet, docs/benchmarks/fit_spread/joint/) resampled with replacement {draws} times "
             "(seed 0), each resample's per-probe median fitted as a run fits it. Each kind's share of the dense "
             "latency, in per cent: the fit to every timing, [5th-95th percentile over the resamples]; and the width "
             "of the 90% interval of the speed-up those fits predict for the {plans} plans `plan_repro.py speed` "
             "timed, over the pooled fit's prediction. The last two columns: half that interval for {shown}'s price, "
             "relative to it, and how many timings would narrow it to ±{nudge:.0%} if it shrinks as 1 / sqrt(timings) "
             "(in CPU time, the calls alone: the probes' median times, {repeats} calls each per timing).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "table"])
    parser.add_argument("--runs", type=Path, default=ROOT.parent / "runs" / "sensitivity")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--only", nargs="+", choices=[name_of(*n) for n in NUDGES],
                        help="run these nudges only (two processes can share the list)")
    args = parser.parse_args(argv)
    if args.stage == "run":
        for kind, factor in NUDGES:
            if args.only and name_of(kind, factor) not in args.only:
                continue
            if (args.results / f"{name_of(kind, factor)}.json").is_file():
                print(f"{name_of(kind, factor)}: done")
                continue
            try:
                run_one(kind, factor, args.runs, args.results)
            except subprocess.CalledProcessError as err:
                raise SystemExit(f"{name_of(kind, factor)} failed ({err}); see its log under {args.runs}") from None
    plans = fit_spread.measured_plans()
    precision, _ = precision_table(plans=plans)
    said = PRECISION.format(draws=DRAWS, plans=len(plans), shown=SHOWN, nudge=NUDGE, repeats=Workload().repeats)
    body = f"{nudge_table(args.results)}\n\n{said}\n\n{precision}"
    write_readme(args.results, "How precise a latency fit must be, and how precise one timed here is "
                 "(benchmarks/price_sensitivity.py)", INTRO.format(reference=REFERENCE), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
