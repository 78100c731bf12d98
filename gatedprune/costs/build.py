"""The cost of a model in one unit (``params``, ``flops``, ``latency``) for a workload, and its gates' under it.

Latency is looked up before it is measured: ``pruning.workload.table`` if given, else a fit cached in one of
``cache_dirs`` (the directory of the checkpoint a fork starts from, then the run's own checkpoints) or in this
machine's cache (``table.machine_dir``), else measured here (``timer``, default the workload runtime's) and cached in
the first of ``cache_dirs`` that can be written and in the machine's cache: forks of one checkpoint measure once,
and so does a machine, for each model shape and workload. Two runs that each timed their own fit would price the
kinds by their timings and could ship two plans (docs/gates.md 0c); a run started after another's set-up here is
priced by that one's fit (two started at once each time their own). A fit found beside a checkpoint comes first and
is kept in the machine's cache where it has none; one found in the machine's cache is kept beside the checkpoint,
for its forks and resumes. The machine's cache holds fits to a table's standard: a fit goes into it only when it
meets its probes within ``keep_tolerance`` (one that only met ``fit_tolerance`` after its last timing prices this
run and its forks), and it times again a file it cannot read, or a fit that misses its probes by more than this
run's ``keep_tolerance``.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from gatedprune.costs import latency, table
from gatedprune.costs.flops import flops_cost
from gatedprune.costs.linear import LinearCost, StructureCosts
from gatedprune.costs.timers import TIMERS
from gatedprune.costs.workload import Workload
from gatedprune.shipping.export import dense_copy  # the gated model without its gate hooks


# a fit timed at set-up follows the machine's timings (docs/gates.md 0c: on a shared 2-core machine a run's fit put
# the decoder layer at 0-49% of the latency), and the plan follows the fit: every later run here reuses this one
ONE_PLAN = ("note: this latency fit prices every later run of this model's shapes and workload on this machine "
            "({path}; delete it to time the probes again), so they ship one plan. Another machine times its own, "
            "which prices the kinds otherwise. For one plan on every machine, measure a table once "
            "(gatedprune-latency MODEL_DIR TABLE.json) and give it to every run (pruning.workload.table=TABLE.json)")
NOISY = ("note: after {timings} timings this latency fit still misses its probes by {error:.1%}, more than "
         "{setting}: it prices this run{forks} but is not kept "
         "for later runs on this machine, which time their own and can ship another plan. For one plan every run, "
         "time a table on a quieter machine (gatedprune-latency MODEL_DIR TABLE.json) and give it to every run "
         "(pruning.workload.table=TABLE.json)")
NOT_KEPT = ("note: a latency fit timed here prices each kind by this run's timings, and it could not be kept for "
            "the next run ({error}): another run's fit on a shared machine prices the kinds otherwise and can ship "
            "another plan. For one plan every run, measure a table once (gatedprune-latency MODEL_DIR TABLE.json) and "
            "give it to every run (pruning.workload.table=TABLE.json)")


def latency_cost(model: nn.Module, workload: Workload, cache_dirs: list[Path] = (), timer=None) -> tuple[LinearCost, dict]:
    """(cost, where it came from: {"source": "table" | "cache" | "measured", "path", "device", and for a measured
    fit its "probes" and "fit_error", the largest relative error over them})."""
    wanted = table.key(model, workload)
    if workload.table is not None:
        saved, cost, probes = table.read(Path(workload.table))
        table.check_match(Path(workload.table), saved, wanted)
        return cost, _checked({"source": "table", "path": str(workload.table), "device": saved["device"]}, probes,
                              workload)
    name = table.file_name(wanted)
    machine = table.machine_dir()
    beside = [Path(d) / name for d in cache_dirs]  # the checkpoint forked, then the run's own
    for directory in [*cache_dirs, machine]:
        path = Path(directory) / name
        found = _cached(path, wanted, workload, in_machine=directory == machine)
        if found is not None:
            cost, probes, device = found
            # kept where the next run looks first too: beside the checkpoint (its forks and resumes), and in the
            # machine's cache (later runs of this key here)
            if not any(p.is_file() for p in beside):
                _save_first(beside, wanted, cost, probes)
            if directory != machine and not (machine / name).is_file() and _keeps(probes, workload):
                _save(machine / name, wanted, cost, probes)
            where = "timed earlier on this machine" if directory == machine else "kept beside the checkpoint"
            print(f"latency fit: {path}, {where} ({device}); delete it to time the probes again")
            return cost, _checked({"source": "cache", "path": str(path), "device": device}, probes, workload)
    print(f"measuring latency per structure ({workload.runtime}, batch {workload.batch}, {workload.source_tokens} -> "
          f"{workload.target_tokens} tokens, beams {workload.num_beams}, {wanted['device']})")
    cost, probes = latency.fit_latency(dense_copy(model), workload, timer or TIMERS[workload.runtime])
    info = {"source": "measured", "path": None, "device": wanted["device"], "probes": probes,
            "fit_error": latency.fit_error(probes)}
    print(f"latency fit: {1000 * cost.base:.2f} ms per call plus each structure's cost; its largest error over its "
          f"{len(probes)} probes {info['fit_error']:.1%}")
    kept = _save_first(beside, wanted, cost, probes)  # forks of this checkpoint are priced alike, whatever its error
    if not _keeps(probes, workload):  # a fit of the noise: not for every later run here
        print(NOISY.format(timings=len(probes[0]["timings"]), error=info["fit_error"], setting=workload.aim_setting,
                           forks=" (and forks of its checkpoint)" if kept else ""))
        info["path"] = str(kept) if kept else None
        return cost, info
    error = _save(machine / name, wanted, cost, probes)
    print(NOT_KEPT.format(error=error) if error else ONE_PLAN.format(path=machine / name))
    info["path"] = str(kept) if kept else (None if error else str(machine / name))
    return cost, info


def _keeps(probes: list[dict], workload: Workload) -> bool:
    """Whether a fit is good enough for the machine's cache: within ``workload.aim`` of its probes (a file that keeps
    none, a table written elsewhere, is taken as it is)."""
    return not probes or latency.fit_error(probes) <= workload.aim


def _cached(path: Path, wanted: dict, workload: Workload, in_machine: bool):
    """(cost, probes, device) of the fit cached at ``path`` for this key, or None: no file, another key (a hash
    collision, an edited file), or, in the machine's cache, a file that does not read or a fit that misses its probes
    by more than this run's ``keep_tolerance`` (a run with a looser one timed it): those are timed again."""
    if not path.is_file():
        return None
    try:
        saved, cost, probes = table.read(path)
    except ValueError as err:
        if not in_machine:
            raise
        print(f"note: {path} is not a latency fit gatedprune can read ({err}); timing the probes again")
        return None
    if saved != wanted:
        return None
    if in_machine and not _keeps(probes, workload):
        print(f"note: the latency fit {path} misses its probes by up to {latency.fit_error(probes):.1%}, above "
              f"{workload.aim_setting}; timing the probes again")
        return None
    return cost, probes, saved["device"]


def _save_first(paths: list[Path], key: dict, cost: LinearCost, probes: list[dict]) -> Path | None:
    """The first of ``paths`` that takes the fit (each one that does not is noted), or None."""
    for path in paths:
        if _save(path, key, cost, probes) is None:
            return path
    return None


def _save(path: Path, key: dict, cost: LinearCost, probes: list[dict]) -> str | None:
    """Cache a fit at ``path``; None, or why it could not be written (printed)."""
    try:
        table.save(path, key, cost, probes)
    except OSError as err:
        print(f"note: the latency fit is not cached in {path.parent} ({type(err).__name__}: {err})")
        return f"{type(err).__name__}: {err}"
    return None


def _checked(info: dict, probes: list[dict], workload: Workload) -> dict:
    """``info`` of a fit read from a file, with its largest error over the probes it was fitted to (when the file
    keeps them), and a warning above ``workload.fit_tolerance``: such a fit is reused, not measured again."""
    if not probes:
        return info
    error = latency.fit_error(probes)
    if error > workload.fit_tolerance:
        again = ("delete it to measure again" if info["source"] == "cache" else
                 "measure it again with gatedprune-latency on that machine")
        print(f"warning: the latency fit {info['path']} misses its probes by up to {error:.0%} (pruning.workload."
              f"fit_tolerance={workload.fit_tolerance:g}): its predictions are that uncertain; {again}")
    return {**info, "fit_error": error}


def linear_cost(unit: str, model: nn.Module, workload: Workload, cache_dirs=(), timer=None) -> tuple[LinearCost, dict]:
    if unit == "flops":
        return flops_cost(model, workload), {"source": "formula"}
    if unit == "latency":
        return latency_cost(model, workload, cache_dirs, timer)
    raise ValueError(f"unknown cost unit {unit!r}; allowed: flops, latency (parameters are counted on the gates)")


def gate_costs(unit: str, model: nn.Module, gates, workload: Workload, cache_dirs=(), timer=None) -> dict:
    """Set ``gates``' costs in ``unit`` (``HeadGates.set_costs``); returns what they were made from."""
    if unit == "params":
        return {"source": "counted"}
    cost, info = linear_cost(unit, model, workload, cache_dirs, timer)
    gates.set_costs(unit, StructureCosts.of_linear(cost, model, gates))
    return {**info, "base": cost.base, "coefficients": cost.coefficients}
