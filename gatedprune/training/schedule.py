"""A run's schedule: where its dense phase ends, how many gated steps follow, and a fork's, taken from its checkpoint.

A run trains ``dense_steps`` optimiser steps with the gates open (the gated methods' ``pruning.start_step``), then
``gated_steps``: ``trainer.max_steps = dense_steps + gated_steps``. ``gated_steps`` defaults to ``trainer.max_steps -
dense_steps`` (``conf/train.yaml``), so a config that names only ``trainer.max_steps`` means what it always did.

A fork starts from a checkpoint that another run saved where its dense training ended (its ``dense.ckpt``, or a
checkpoint saved at its ``pruning.start_step``) at global step N. Its dense phase is then N, its learning-rate
schedule the checkpoint's (``optim.lr`` and ``optim.warmup_steps`` as its hyperparameters hold them; the optimiser
and scheduler state come with the checkpoint, so the schedule goes on from step N), and it trains ``gated_steps``
after N. ``experiment=converge``'s ``dense.ckpt`` is the case this is for: it is saved at a step no config names,
by a run whose ``dense_steps`` and ``trainer.max_steps`` (100000) are bounds only. What the composed config says
otherwise gives way, with a note. A value given on the command line that disagrees with the checkpoint is refused in
one line: whoever typed it expected another schedule. Two cases are not forks and keep the config's steps as they
are: a run that gates nothing (its dense phase reaches ``trainer.max_steps``: a dense model trained on to a fixed
step), and a checkpoint saved inside a dense phase that went on (a ``last.ckpt``: the run is continued, its boundary
where its config puts it).

The comparison presets (``conf/compare``, ``conf/quality``) count every method's training after the dense checkpoint
with ``gated_steps``: a method that trains nothing before its export fine-tunes it ``gated_steps + finetune_steps``
(``${gp.add:...}``, registered here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gatedprune.training.checkpoints import named_checkpoint, peek_checkpoint

# the optim fields that shape the learning rate over the steps (gatedprune.training.module.OptimConfig); a fork
# takes them from its checkpoint
SCHEDULE_FIELDS = ("lr", "warmup_steps")


def _steps(*values):
    """None if any value is (an unbounded trainer), else the values as integers."""
    return None if any(v is None for v in values) else [int(v) for v in values]


def _add(*values):
    values = _steps(*values)
    return None if values is None else sum(values)


def _sub(a, b):
    values = _steps(a, b)
    return None if values is None else values[0] - values[1]


for _name, _resolver in (("gp.add", _add), ("gp.sub", _sub)):  # ${gp.add:a,b}, ${gp.sub:a,b}: steps in the configs
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


@dataclass(frozen=True)
class ForkPoint:
    """A checkpoint saved where its run's dense training ended, at global step ``step``."""

    path: Path
    step: int
    optim: dict  # its hyperparameters' optim settings (the learning-rate schedule)
    continued: bool = False  # a run (a fork, or one whose dense phase has changed since) continued past step

    @property
    def where(self) -> str:
        if self.continued:
            return f"a run continued from {self.path} (its gated phase began at step {self.step})"
        return f"a fork of {self.path} (saved at step {self.step}, where its dense training ended)"


def fork_point(resume: str | None, run_dir: Path) -> ForkPoint | None:
    """The checkpoint ``resume`` names if this run forks it: another run's, saved where that run's dense training
    ended (at its ``pruning.start_step``, or its ``dense.ckpt``, which a converged run saves before its start step).
    Keyed on what ``resume`` names, so a fork relaunched in its own directory (continuing from its own last.ckpt) keeps
    the schedule it started with. None otherwise: a gated checkpoint, a dense phase cut short, this run's own."""
    path = named_checkpoint(resume)
    if path is None or run_dir.resolve() in path.resolve().parents:
        return None
    saved = peek_checkpoint(path)
    hparams = saved["hyper_parameters"]
    start, step = (hparams.get("pruning") or {}).get("start_step"), saved["global_step"]
    if start is None or step is None or step > start or (step < start and path.name != "dense.ckpt"):
        return None
    return ForkPoint(path, int(step), dict(hparams.get("optim") or {}))


def continued_run(resume: str | None, run_dir: Path, start: int) -> ForkPoint | None:
    """The checkpoint this run continues from (its own last.ckpt, else the one ``resume`` names) when its gated phase
    began at a step other than ``start``, the dense phase the config says: a fork continued (``resume=auto`` in its
    own directory, or ``resume=<the fork's run directory>``) keeps the boundary and the schedule it had. None for a
    run whose boundary agrees, or that is still in its dense phase (continued as configured)."""
    own = run_dir / "checkpoints" / "last.ckpt"
    path = own if own.is_file() else named_checkpoint(resume)
    if path is None:
        return None
    saved = peek_checkpoint(path)
    hparams = saved["hyper_parameters"]
    began, step = (hparams.get("pruning") or {}).get("start_step"), saved["global_step"]
    if began is None or step is None or step <= began or began == start:
        return None
    return ForkPoint(path, int(began), dict(hparams.get("optim") or {}), continued=True)


def command_line_keys(cfg: DictConfig) -> set[str]:
    """The config keys set on the command line (``dense_steps=...``, ``+quality=plain``: quality): the composed
    config's record of them (``compose(..., return_hydra_config=True)``), or Hydra's of the running job; empty when
    neither is there (a config composed in Python: nothing counts as typed)."""
    from hydra.core.hydra_config import HydraConfig

    task = OmegaConf.select(cfg, "hydra.overrides.task", default=None)
    if task is None:
        task = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    return {str(o).split("=", 1)[0].lstrip("+~") for o in task}


def settle(cfg: DictConfig, run_dir: Path) -> dict:
    """Fix ``dense_steps``, ``gated_steps``, ``trainer.max_steps`` (and, on a fork, ``optim``'s schedule) in ``cfg``,
    in place, before anything is built from it; returns the schedule for ``status.json``. ``ValueError`` (one line)
    for values that contradict each other or the checkpoint forked."""
    given = command_line_keys(cfg)
    if "finetune.steps" in given and "finetune_steps" in cfg:
        raise ValueError(
            f"finetune.steps={cfg.finetune.steps} with a comparison preset, which gives each method its finetune.steps "
            "from finetune_steps (the methods that train nothing before their export: gated_steps + finetune_steps, as "
            f"long after the dense checkpoint as the gates); allowed: finetune_steps={cfg.finetune.steps}")
    fork = fork_point(cfg.get("resume"), run_dir)
    has_start = "start_step" in cfg.pruning  # the gated methods' dense phase; the others only read dense_steps
    start = cfg.pruning.start_step if has_start else cfg.dense_steps
    if fork is None and has_start:
        fork = continued_run(cfg.get("resume"), run_dir, start)
    max_steps = cfg.trainer.get("max_steps")
    bounded = max_steps is not None and max_steps >= 0
    # given, rather than the default trainer.max_steps - dense_steps (or null, which says the same)
    gated_set = not OmegaConf.is_interpolation(cfg, "gated_steps") and cfg.gated_steps is not None
    gated = cfg.gated_steps if gated_set else (max_steps - start if bounded else None)
    if gated_set and (isinstance(gated, bool) or not isinstance(gated, int) or gated < 0):
        raise ValueError(f"gated_steps={gated!r}; allowed: an integer >= 0 (null: trainer.max_steps - dense_steps)")

    dense_run = not gated_set and bounded and start >= max_steps  # no gated step: a dense model trained on, as it is
    if fork is not None and dense_run and max_steps < fork.step:
        raise ValueError(f"trainer.max_steps={max_steps} on a fork of {fork.path}, saved at step {fork.step}: a run "
                         f"that gates nothing (dense phase {start} steps) would end before it starts; allowed: "
                         f"trainer.max_steps >= {fork.step} (the dense model trained on to that step)")
    if fork is not None and not dense_run:
        _settle_fork(cfg, fork, given, has_start, start, gated, gated_set)
    elif fork is not None:  # the dense model trained on from the checkpoint: its steps as given, at its rate
        changes = take_schedule(cfg, fork, given)
        if changes:
            print(f"note: {fork.where}: {', '.join(changes)}")
    elif gated_set:
        if "trainer.max_steps" in given and max_steps != start + gated:
            raise ValueError(f"trainer.max_steps={max_steps} with gated_steps={gated} after a dense phase of {start} "
                             f"steps: trainer.max_steps is {start + gated}; allowed: one of the two")
        cfg.trainer.max_steps = start + gated
    if dense_run:
        gated = 0  # nothing is gated: not a negative count
    if gated is not None:
        cfg.gated_steps = gated  # the presets count it: fixed, however dense_steps and max_steps were settled
    start = cfg.pruning.start_step if has_start else cfg.dense_steps
    return {"start_step": start, "gated_steps": gated, "max_steps": cfg.trainer.get("max_steps"),
            "warmup_steps": cfg.optim.get("warmup_steps"),
            "fork": {"checkpoint": str(fork.path), "step": fork.step, "continued": fork.continued} if fork else None}


def _settle_fork(cfg: DictConfig, fork: ForkPoint, given: set[str], has_start: bool, start: int, gated: int | None,
                 gated_set: bool) -> None:
    """Give ``cfg`` the fork's schedule: dense phase ``fork.step``, then ``gated`` steps, at the checkpoint's rate."""
    n, where = fork.step, fork.where
    for key in ("dense_steps", "pruning.start_step"):
        value = OmegaConf.select(cfg, key)
        if key in given and value != n:
            raise ValueError(f"{key}={value} on {where}: a fork's dense phase ends at its checkpoint's step; "
                             f"allowed: {key} unset (it is then {n}), or gated_steps=<steps> for the gated phase")
    max_steps = cfg.trainer.get("max_steps")
    if "trainer.max_steps" in given and gated is not None and max_steps != n + gated:
        meant = f"gated_steps={gated}" if gated_set else f"gated_steps={max_steps - start} if that is the gated phase"
        raise ValueError(f"trainer.max_steps={max_steps} on {where}: the gated phase follows the checkpoint's step, so "
                         f"trainer.max_steps is {n} + gated_steps; allowed: trainer.max_steps unset, or {meant}")
    changes = take_schedule(cfg, fork, given)
    if start != n:
        changes.insert(0, f"dense_steps {start} -> {n}")
    cfg.dense_steps = n
    if has_start and not OmegaConf.is_interpolation(cfg.pruning, "start_step"):  # a preset's own value
        cfg.pruning.start_step = n
    if gated is not None:
        if max_steps != n + gated:
            changes.append(f"trainer.max_steps {max_steps} -> {n + gated} ({gated} gated steps)")
        cfg.trainer.max_steps = n + gated
    if changes:
        print(f"note: {where}: {', '.join(changes)}")


def take_schedule(cfg: DictConfig, fork: ForkPoint, given: set[str]) -> list[str]:
    """Give ``cfg`` the checkpoint's learning-rate schedule (``SCHEDULE_FIELDS``); returns what changed. A typed value
    that disagrees is refused in one line."""
    changes = []
    for key in SCHEDULE_FIELDS:
        if key not in fork.optim or key not in cfg.optim or cfg.optim[key] == fork.optim[key]:
            continue
        if f"optim.{key}" in given:
            raise ValueError(f"optim.{key}={cfg.optim[key]} on {fork.where}, whose schedule has optim.{key}="
                             f"{fork.optim[key]}: a fork goes on with its checkpoint's learning-rate schedule; "
                             f"allowed: optim.{key} unset, or {fork.optim[key]}")
        changes.append(f"optim.{key} {cfg.optim[key]} -> {fork.optim[key]}")
        cfg.optim[key] = fork.optim[key]
    return changes
