"""Latency per structure, fitted: time the dense model and cut copies of it, solve for a cost per structure.

The probes are the dense model, for each kind one copy with every layer's structures of that kind shrunk to each
of ``workload.probe_fractions`` (heads and FFN units: the first ones kept; layers: evenly spaced ones, a decoder
keeping one), and (``workload.joint_probes``) one copy per fraction with every kind shrunk to it at once. A plan
cuts every kind at once: probes of one kind each leave the base (what no cut removes) to the difference of many
small savings, each within the calls' noise, so a fit can meet them and still misprice a plan (docs/gates.md 0c).
With n_jk the structures of kind k in probe j (``counts.features``) and t_j its time, the fit is the ``LinearCost``
with

    minimise  sum_j ((base + sum_k c_k n_jk - t_j) / t_j)^2     subject to  c_k >= 0

relative errors, since a prediction is judged by its ratio to the measurement; a coefficient that would go
negative (timing noise on a cheap kind) is held at 0 and the rest refitted. The expected latency of the gates is
then linear in their nested P(open) (``linear.StructureCosts``), as the budget needs.

A fit is checked against its own probes: on a shared machine a burst of load can inflate several probes' times
at once (seen here: the dense probe predicted 33% off, probes that removed structures timed up to 60% slower than
the dense model), and such a fit prices structures by the load, not by what they cost; and a fit of one timing
can price the kinds by its calls' noise (docs/gates.md 0c). Where the largest relative error over the probes exceeds
``workload.aim`` (``keep_tolerance``, 5%: a table's standard) the probes are timed again, up to
``workload.fit_attempts`` timings in all, and each fit is made from every timing so far: per probe, the median over
the timings (one loaded timing among three is outvoted; each timing is itself the median of ``workload.repeats``
interleaved calls). A fit that still misses its probes by more than ``workload.fit_tolerance`` after the last
timing is refused (``LatencyFitError``, one line): a plan priced by the load would differ from run to run. One
between the two is returned; the caller does not keep it for later runs (``costs.build``).

The timer is a parameter: ``timer(models, workload) -> [seconds]`` (``timers``), so a test can inject a fake one.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from torch import nn

from gatedprune.costs.counts import features, kind_sites
from gatedprune.costs.linear import LinearCost
from gatedprune.costs.workload import Workload
from gatedprune.errors import RunFailed
from gatedprune.structures.adapters import probe as probe_layout
from gatedprune.structures.kinds import ALL_KINDS, KINDS
from gatedprune.surgery.cut import prune_heads


JOINT = "every kind"  # the name of a probe that shrinks every kind at once: "every kind 0.5"


def probe_plans(model: nn.Module, fractions: tuple, joint: bool = True) -> list[tuple[str, dict]]:
    """``[(name, plan)]``: the dense model (an empty plan), then each kind shrunk to each fraction, then (``joint``)
    every kind shrunk at once to each fraction (where the model has more than one kind to shrink)."""
    plans, together = [("dense", {})], {fraction: [] for fraction in fractions}
    layers = probe_layout(model).layers
    for kind, sites in kind_sites(model).items():
        spec = KINDS[kind]
        for fraction in fractions:
            if spec.structure == "layer":
                total = len(model.get_submodule(layers[spec.stack]))
                keep = max(round(fraction * total), 1 if spec.stack == "decoder" else 0)
                if keep >= total:
                    continue
                spaced = sorted({round(i * (total - 1) / max(keep - 1, 1)) for i in range(keep)}) if keep else []
                plan = (f"{kind} {keep}/{total}", {layers[spec.stack]: spaced})
            else:
                plan = (f"{kind} {fraction:g}", first_units(sites, fraction))
            plans.append(plan)
            together[fraction].append(plan[1])
    if joint:  # the sites of a dropped layer are skipped by the cut (``surgery.cut``), so the plans merge as they are
        plans += [(f"{JOINT} {fraction:g}", {path: kept for plan in shrunk for path, kept in plan.items()})
                  for fraction, shrunk in together.items() if len(shrunk) > 1]
    return plans


def first_units(sites, fraction: float) -> dict[str, list[int]]:
    """The plan that keeps the first ``fraction`` of each site's heads or units (which ones are kept does not change
    the time)."""
    return {s.path: list(range(round(fraction * s.num_units))) for s in sites}


def probe_models(model: nn.Module, fractions: tuple, joint: bool = True) -> list[tuple[str, nn.Module]]:
    """The probe plans cut out of copies of ``model`` (which is left as it is)."""
    return [(name, prune_heads(copy.deepcopy(model), plan) if plan else copy.deepcopy(model))
            for name, plan in probe_plans(model, fractions, joint)]


def fit(rows: list[dict[str, int]], seconds: list[float]) -> tuple[float, dict[str, float]]:
    """(base, {kind: c_k}) of the non-negative relative least-squares fit (see the module)."""
    kinds = [k for k in ALL_KINDS if len({row[k] for row in rows}) > 1]  # only what the probes varied is identifiable
    t = np.asarray(seconds, dtype=np.float64)  # (J,)
    X = np.asarray([[1.0, *(row[k] for k in kinds)] for row in rows], dtype=np.float64)  # (J, 1 + K)
    free = list(range(X.shape[1]))
    while True:
        weighted = X[:, free] / t[:, None]
        solution, *_ = np.linalg.lstsq(weighted, np.ones_like(t), rcond=None)
        negative = [free[i] for i, value in enumerate(solution) if value < 0 and free[i] != 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: solution[free.index(i)]))  # the most negative held at 0
    c = np.zeros(X.shape[1])
    c[free] = solution
    constant = {k: rows[0][k] for k in ALL_KINDS if k not in kinds}  # never varied: part of the base
    return float(c[0]), {**dict.fromkeys(constant, 0.0), **{k: float(v) for k, v in zip(kinds, c[1:])}}


def _error(row: dict) -> float:
    """A probe's relative error, |predicted / t - 1|."""
    return abs(row["predicted"] / row["seconds"] - 1)


def fit_error(table: list[dict]) -> float:
    """The largest relative error of a fit over its probes (``fit_latency``'s rows): max_j |predicted_j / t_j - 1|."""
    return max(map(_error, table))


class LatencyFitError(RunFailed):
    """The probes' timings disagree with any additive fit beyond ``workload.fit_tolerance`` after every timing.
    Its settings are named as a run takes them (``pruning.workload.*``), or as ``gatedprune-latency`` does
    (``for_command``)."""

    def __init__(self, probe: str, error: float, attempts: int, tolerance: float, command: bool = False):
        self.probe, self.error, self.attempts, self.tolerance, self.command = probe, error, attempts, tolerance, command
        if command:
            tolerance_key, attempts_key, elsewhere = ("--fit-tolerance", "--fit-attempts",
                                                      "or run this command where the model will be served")
        else:
            tolerance_key, attempts_key, elsewhere = ("pruning.workload.fit_tolerance", "pruning.workload.fit_attempts",
                                                      "or give a fit measured elsewhere (pruning.workload.table=, "
                                                      "written by gatedprune-latency)")
        super().__init__(
            f"the latency fit misses its probe {probe!r} by {error:.0%} after {attempts} timings of its probes "
            f"({tolerance_key}={tolerance:g}): their times follow the machine's load, not the structures; time them "
            f"on a quieter machine, allow more timings ({attempts_key}), {elsewhere}")

    def for_command(self) -> "LatencyFitError":
        return LatencyFitError(self.probe, self.error, self.attempts, self.tolerance, command=True)


def fit_latency(model: nn.Module, workload: Workload, timer) -> tuple[LinearCost, list[dict]]:
    """Time the probes of ``model`` with ``timer`` and fit to the per-probe median of every timing so far, timing
    them again while the fit misses its own probes by more than ``workload.aim``; returns the cost and one row per
    probe (name, structures, the seconds fitted to, each timing's seconds, predicted). ``LatencyFitError`` when the
    last of ``workload.fit_attempts`` timings still misses by more than ``workload.fit_tolerance``."""
    probes = probe_models(model, workload.probe_fractions, workload.joint_probes)
    rows = [features(m) for _, m in probes]
    timings = []  # (attempts, J): one timing of every probe per attempt
    for attempt in range(1, workload.fit_attempts + 1):
        seconds = timer([m for _, m in probes], workload)
        if any(not (s > 0 and math.isfinite(s)) for s in seconds):
            raise ValueError(f"the latency timer returned {seconds}: every time must be a positive number of seconds")
        timings.append([float(s) for s in seconds])
        pooled = np.median(np.asarray(timings), axis=0)  # (J,): robust to one loaded timing once there are three
        base, coefficients = fit(rows, pooled.tolist())
        cost = LinearCost("latency", base, coefficients)
        table = [{"probe": name, "structures": row, "seconds": float(s), "timings": [t[j] for t in timings],
                  "predicted": cost.of(m)} for j, ((name, m), row, s) in enumerate(zip(probes, rows, pooled))]
        error = fit_error(table)
        if error <= workload.aim:
            return cost, table
        worst = max(table, key=_error)["probe"]
        if attempt < workload.fit_attempts:
            print(f"note: the latency fit misses its probe {worst!r} by {error:.1%} ({workload.aim_setting}): "
                  f"timing the probes again ({attempt + 1} of {workload.fit_attempts}), fitting the median of every "
                  "timing")
    if error <= workload.fit_tolerance:
        return cost, table
    raise LatencyFitError(worst, error, workload.fit_attempts, workload.fit_tolerance)
