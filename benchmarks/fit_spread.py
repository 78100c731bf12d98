"""How far a latency fit measured on this machine moves from run to run (issue 38, item 3), kind by kind.

The plan the gates ship follows the price the latency fit puts on each kind (docs/gates.md 0c: two measured fits of
the kept teacher, each inside its tolerance, priced encoder heads free in one and 0.77 ms each in the other, and the
two plans differed in 3,669 structures). This script asks how much of that is the measurement: it times the probes of
the default's fit (``gatedprune.costs.latency``, the teacher, ``Workload()``: batch 1, 32 + 32 tokens, one thread,
each probe the median of three interleaved calls) ``--timings`` times, first while a second process spins on one core
(``plan_repro.busy_core``), then alone, and keeps every timing. ``table`` then replays them through
``fit_latency`` itself, three timings per run as its retries took them until 2026-12-07 (a run fitted the first, then
the median of the first two, then of all three, and stopped at the first within 20%, or refused; since then a run
times to 5%, up to 15 timings, which the "5% tolerance" replay is), and reports each kind's
share of the dense latency, c_k * n_k / (base + sum_j c_j * n_j), from lowest to highest over the runs, beside the
same from each timing fitted alone. A kind whose share moves by as much as it is has no price the gates can rely on.
A second table prices, with each of those fits, the plans ``plan_repro.py speed`` timed beside the teacher: how far
off each fit is, and how far one plan's prediction moves from fit to fit.

    .venv/bin/python benchmarks/fit_spread.py run       # the loads not yet in docs/benchmarks/fit_spread/
    .venv/bin/python benchmarks/fit_spread.py table     # docs/benchmarks/fit_spread/README.md from the records
    .venv/bin/python benchmarks/fit_spread.py run --results docs/benchmarks/fit_spread/joint --timings 15
                                                        # today's probes (2026-12-07, evening), 15 timings per load
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_repro  # noqa: E402  (the busy core)
from common import FIT_UNTIL_2026_12_07, ROOT, command_line, machine, write_readme  # noqa: E402

from gatedprune.costs import table as costs_table  # noqa: E402
from gatedprune.costs.counts import features  # noqa: E402
from gatedprune.costs.latency import (LatencyFitError, fit, fit_error, fit_latency, probe_models,  # noqa: E402
                                      probe_plans)
from gatedprune.costs.linear import LinearCost  # noqa: E402
from gatedprune.costs.workload import Workload  # noqa: E402
from gatedprune.structures.kinds import ALL_KINDS  # noqa: E402
from gatedprune.teacher import LATENCY_TABLE  # noqa: E402
from gatedprune.utils import atomic_write_text, markdown_table  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "fit_spread"
LOADS = plan_repro.LOADS  # busy first
# how a run timed its fit when these were measured (since then: to 5%, up to 15, which the "5% tolerance" replay is)
PER_RUN = FIT_UNTIL_2026_12_07["fit_attempts"]
RUN_TOLERANCE = FIT_UNTIL_2026_12_07["fit_tolerance"]
ORDERS = 20  # orders of a record's timings replayed where it has the joint probes (seeds 0-19)
TIGHT = 0.05  # the tolerance docs/guide/speed_targets.md measures a table with: just above what 45 calls per probe miss


def load_model(path: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def measure(model, load: str, timings: int, timer) -> dict:
    """Every probe of ``model``'s default fit timed ``timings`` times with ``timer``, beside a busy core or not."""
    workload = Workload()  # today's default, the joint probes with it
    probes = probe_models(model, workload.probe_fractions, workload.joint_probes)
    with plan_repro.busy_core(load == "busy"):
        seconds = [[float(s) for s in timer([m for _, m in probes], workload)] for _ in range(timings)]
    return {"load": load, "date": date.today().isoformat(), "machine": machine(), "model": _shown(model.name_or_path),
            "workload": workload.decoding(),
            "probes": [{"probe": name, "structures": features(m)} for name, m in probes], "timings": seconds}


def _shown(path: str) -> str:
    """A model path as the record keeps it: relative to the checkout when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def shares(cost, dense: dict[str, int]) -> dict[str, float]:
    """Each kind's share of the dense model's predicted latency, and the base's: c_k * n_k / total."""
    total = cost.of_counts(dense)
    return {"base": cost.base / total, **{k: cost.coefficients.get(k, 0.0) * dense[k] / total for k in ALL_KINDS}}


def replay(model, timings: list[list[float]], tolerance: float = RUN_TOLERANCE, joint: bool = False) -> dict:
    """The fit ``fit_latency`` makes from these timings, taken in order (one per retry) until one misses its probes
    by ``tolerance`` at most: the kinds' shares, the fit's error over its probes and how many timings it took; or the
    line it refused with. ``joint``: the timings include the probes that shrink every kind at once."""
    queue = list(timings)
    workload = Workload(fit_attempts=len(timings), fit_tolerance=tolerance, keep_tolerance=tolerance,
                        joint_probes=joint)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its notes on each retry: the record says how many it took
            cost, probes = fit_latency(model, workload, lambda models, _: queue.pop(0))
    except LatencyFitError as err:
        return {"refused": str(err)}
    return {"shares": shares(cost, probes[0]["structures"]), "error": fit_error(probes),
            "timings": len(timings) - len(queue)}


def pooled(record: dict) -> dict:
    """The fit to the per-probe median of every timing in ``record`` (what a run would fit after that many retries,
    whatever its tolerance): the kinds' shares and its error over its probes."""
    rows = [p["structures"] for p in record["probes"]]
    seconds = np.median(np.asarray(record["timings"]), axis=0)  # (J,)
    cost = LinearCost("latency", *fit(rows, seconds.tolist()))
    probes = [{"seconds": t, "predicted": cost.of_counts(row)} for row, t in zip(rows, seconds.tolist())]
    return {"shares": shares(cost, rows[0]), "error": fit_error(probes), "timings": len(record["timings"])}


def joint_of(record: dict) -> bool:
    """Whether a record timed the probes that shrink every kind at once (those before 2026-12-07's evening did not)."""
    return bool(record["workload"].get("joint_probes", False))


def fits(model, record: dict, singles: bool = True, orders: int = None) -> dict[str, list[dict]]:
    """``{"a run": [...], "one timing": [...], "every timing": [one], "5% tolerance": [one]}``: a run's fit per
    ``PER_RUN`` consecutive timings, each timing's fit alone (the same ``fit_latency``, one attempt), the fit to all
    of them, and the fit a run makes with ``fit_tolerance`` ``TIGHT`` and every timing as its retries. A record with
    the joint probes adds that run's fit over ``orders`` (default ``ORDERS``) orders of its timings, with them and
    with the probes of one kind each alone (the same timings: what the joint probes change)."""
    timings, joint = record["timings"], joint_of(record)
    runs = [replay(model, timings[i:i + PER_RUN], joint=joint) for i in range(0, len(timings) - PER_RUN + 1, PER_RUN)]
    one = {"one timing": [replay(model, [t], joint=joint) for t in timings]} if singles else {}  # most of the replays
    found = {"a run": runs, **one, "every timing": [pooled(record)],
             "5% tolerance": [replay(model, timings, TIGHT, joint)]}
    if joint:
        single = len(probe_plans(model, Workload().probe_fractions, joint=False))  # the joint probes come last
        shuffled = [np.random.default_rng(seed).permutation(len(timings)) for seed in range(orders or ORDERS)]
        found[f"5% tolerance, {len(shuffled)} orders"] = [replay(model, [timings[i] for i in order], TIGHT, True)
                                                          for order in shuffled]
        found[f"5% tolerance, {len(shuffled)} orders, one kind per probe"] = [
            replay(model, [timings[i][:single] for i in order], TIGHT) for order in shuffled]
    return found


def spread(results: list[dict], kind: str) -> str:
    """"lowest-highest" per cent of a kind's share over the fits that were made (a refused run has none); one fit's
    share alone, or where every fit gives the same."""
    values = [f"{100 * r['shares'][kind]:.1f}" for r in results if r.get("shares")]
    if not values:
        return "-"
    low, high = min(values, key=float), max(values, key=float)
    return low if low == high else f"{low}-{high}"


def fitted(model, results: Path, singles: bool = True, orders: int = None) -> list[tuple[str, dict, dict]]:
    """``[(load, its record, its fits)]`` for each load recorded in ``results`` (``fits``), each record checked to
    have timed the probes of ``model``."""
    out = []
    for load in LOADS:
        path = results / f"{load}.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        counted = [features(m) for _, m in probe_models(model, Workload().probe_fractions, joint_of(record))]
        if counted != [p["structures"] for p in record["probes"]]:
            raise ValueError(f"{path} timed the probes of another model ({record.get('model')}); allowed: --model of "
                             "the model it timed")
        out.append((load, record, fits(model, record, singles, orders)))
    return out


def table(model, results: Path, kept: Path | None = LATENCY_TABLE, singles: bool = True, orders: int = None,
          found: list | None = None) -> str:
    """Each kind's share per load and fit (``found``: ``fitted``'s, made here when not given)."""
    rows = []
    for load, _, by_how in found if found is not None else fitted(model, results, singles, orders):
        for how, replays in by_how.items():
            made = [r for r in replays if r.get("shares")]
            refused = len(replays) - len(made)
            errors = [r["error"] for r in made]
            took = sorted({r["timings"] for r in made})
            rows.append([load, how, f"{len(made)}" + (f" (+{refused} refused)" if refused else ""),
                         "-" if not took else str(took[0]) if len(took) == 1 else f"{took[0]}-{took[-1]}",
                         (f"{min(errors):.1%}-{max(errors):.1%}" if len(errors) > 1 else f"{errors[0]:.1%}")
                         if errors else "-",
                         *(spread(replays, kind) for kind in ("base", *ALL_KINDS))])
    if kept is not None:  # the table the default prices the teacher with, measured elsewhere, beside them
        _, cost, probes = costs_table.read(kept)
        rows.append(["-", f"the kept table ({kept.name})", "1", "-", f"{fit_error(probes):.1%}",
                     *(spread([{"shares": shares(cost, probes[0]["structures"])}], kind)
                       for kind in ("base", *ALL_KINDS))])
    return markdown_table(["load", "fit from", "fits", "timings it took", "fit error", "base %",
                           *(f"{k} %" for k in ALL_KINDS)], rows)


def measured_plans(results: Path = plan_repro.RESULTS) -> dict[str, tuple[dict, float]]:
    """``{run: (the structures its plan keeps per kind, its measured speed-up)}`` for every plan ``plan_repro.py
    speed`` timed beside the teacher (the mean over its speed records)."""
    measured: dict[str, list[float]] = {}
    for path in sorted(results.glob("speed_*.json")):
        for row in json.loads(path.read_text())["rows"]:
            measured.setdefault(row["name"], []).append(row["measured"])
    return {name: (json.loads((results / f"{name}.json").read_text())["kept"], float(np.mean(values)))
            for name, values in measured.items()}


def speed_up(shares: dict, dense: dict, kept: dict) -> float:
    """The speed-up a fit of these shares predicts for a model keeping ``kept`` of the ``dense`` model's structures:
    1 / (base + sum_k share_k * kept_k / dense_k)."""
    return 1 / (shares["base"] + sum(shares[k] * kept[k] / dense[k] for k in ALL_KINDS if dense[k]))


def pricing(found: list[dict], dense: dict, plans: dict[str, tuple[dict, float]]) -> list[str] | None:
    """How the fits made price the measured plans: the median over fits of the mean |predicted / measured - 1| over
    the plans, the worst such miss, and how far one plan's prediction moves across the fits (sd / mean, the mean over
    the plans; one fit: -)."""
    made = [r["shares"] for r in found if r.get("shares")]
    if not made or not plans:
        return None
    predicted = np.asarray([[speed_up(shares, dense, kept) for kept, _ in plans.values()] for shares in made])  # (F, P)
    off = np.abs(predicted / np.asarray([m for _, m in plans.values()]) - 1)
    moves = f"{np.mean(predicted.std(axis=0) / predicted.mean(axis=0)):.1%}" if len(made) > 1 else "-"
    return [f"{np.median(off.mean(axis=1)):.1%}", f"{off.max():.1%}", moves]


def price_table(model, results: Path, plans: dict, orders: int = None, found: list | None = None) -> str:
    """Per load and fit (``fitted``'s, each timing's fit alone left out): how they price the measured plans."""
    rows = []
    for load, record, by_how in found if found is not None else fitted(model, results, False, orders):
        dense = record["probes"][0]["structures"]
        for how, made in by_how.items():
            if how == "one timing":
                continue
            priced = pricing(made, dense, plans)
            if priced:
                rows.append([load, how, str(sum(1 for r in made if r.get("shares"))), *priced])
    return markdown_table(["load", "fit from", "fits", "off, median over fits", "worst off",
                           "one plan's prediction moves (sd / mean)"], rows)


INTRO = ("Each kind's share of the dense model's predicted latency (c_k * n_k / total, in per cent), lowest-highest "
         "over the fits made from one record's timings: \"a run\" replays `fit_latency` on three consecutive timings as "
         "a run's retries took them until 2026-12-07 (20%), \"one timing\" fits each timing alone, \"every timing\" fits "
         "the per-probe median of all of them, \"5% tolerance\" replays `fit_latency` on all of them with "
         "`fit_tolerance` 0.05 (the median of every timing so far, until it misses its probes by 5% at most); a record "
         "that timed the probes shrinking every kind at once (`workload.joint_probes`, since 2026-12-07's evening) "
         "adds that replay over 20 orders of its timings (seeds 0-19), with those probes and with the probes of one "
         "kind each alone. The kept teacher, `Workload()` (batch 1, 32 + 32 tokens, one thread, three interleaved "
         "calls per probe); busy: a second process spinning on one core.")


PRICE_INTRO = ("How the same fits price the plans `plan_repro.py speed` timed beside the teacher (each plan's "
               "structures from its record, its measured speed-up the mean of the speed records in "
               "docs/benchmarks/plan_repro/): off is |predicted / measured - 1| for a plan, its mean over the plans "
               "for a fit; \"moves\" is the standard deviation of one plan's predicted speed-up across the fits over "
               "their mean, averaged over the plans (a run that prices plans alike from run to run moves little).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["run", "table"])
    parser.add_argument("--model", default=str(ROOT / "teacher"), help="the model whose probes are timed")
    parser.add_argument("--timings", type=int, default=5 * PER_RUN, help="timings of every probe per load")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.timings < PER_RUN or args.timings % PER_RUN:
        parser.error(f"--timings={args.timings}; allowed: a multiple of {PER_RUN} (one run's timings)")
    model = load_model(args.model)
    if args.stage == "run":
        from gatedprune.costs.timers import TIMERS

        for load in LOADS:
            path = args.results / f"{load}.json"
            if path.is_file():
                print(f"{load}: done ({path})")
                continue
            record = measure(model, load, args.timings, TIMERS[Workload().runtime])
            record["command"] = command_line("fit_spread.py", argv if argv is not None else sys.argv[1:])
            args.results.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    plans, found = measured_plans(), fitted(model, args.results)
    shares = table(model, args.results, found=found)
    priced = f"{PRICE_INTRO}\n\n{price_table(model, args.results, plans, found=found)}" if plans else ""
    write_readme(args.results, "How far a measured latency fit moves (benchmarks/fit_spread.py)", INTRO,
                 f"{shares}\n\n{priced}".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
