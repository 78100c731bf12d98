"""One run: compose data, model, module, loggers and trainer from the config, then let the method run itself.

The method (``cfg.pruning``, a ``gatedprune.methods.base.Method``) checks its own settings, says what gating the
module is built with, and runs (fit then ship, or score levels then ship); nothing here asks which method it is.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gatedprune.errors import BAD_INPUT, in_sweep, one_line
from gatedprune.methods.base import Method
from gatedprune.reports.reference import load_reference
from gatedprune.reports.speed import speed_options
from gatedprune.shipping.export import ExportConfig
from gatedprune import teacher  # noqa: F401  (the ${gp.teacher:} resolver of model=teacher)
from gatedprune.training import checkpoints, rundir, schedule
from gatedprune.training.checkpoint_io import with_atomic_checkpoints
from gatedprune.training.csv_logger import ResumableCSVLogger
from gatedprune.training.session import Session


def _instantiate(node, **kwargs):
    """``hydra.utils.instantiate``, with bad input raised as the target raised it (Hydra wraps it otherwise)."""
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, BAD_INPUT):
            raise err.__cause__ from None
        if isinstance(err.__cause__, TypeError):  # an option the target does not take, or a value of the wrong type
            raise ValueError(f"{node._get_full_key(None) or 'config'}: {err.__cause__}") from None
        raise


def train(cfg: DictConfig) -> dict:
    """Run ``cfg`` to the end; returns the metrics that are also written to ``<output_dir>/metrics.json``
    (under DDP, rank 0 does: the other processes only train, and return {}).

    ``<output_dir>/status.json`` says "running", then "done", "interrupted" or "failed" with the error; running and
    done with the run's ``schedule`` (``gatedprune.training.schedule.settle``: a fork's is its checkpoint's). Bad input
    is refused during set-up, before training starts; a run directory made for this run is then removed (a
    member's of a ``-m`` sweep is kept with its failed status, for the sweep's summary to list).
    """
    run_dir = Path(cfg.paths.output_dir)
    if rank_zero_only.rank > 0:  # a DDP process started by rank 0's trainer.fit: it trains, rank 0 reports
        schedule.settle(cfg, run_dir)
        session, method = _setup(cfg, run_dir)
        return method.run(session)
    # a directory that held anything of its own is never removed; a sweep member's stays to show its failure
    fresh = rundir.is_fresh(run_dir) and not in_sweep()
    held = rundir.lock(run_dir)  # before anything is written: another process may own this directory
    steps = {}  # status.json's "schedule" (running, done): where the dense phase ends, the gated steps, the fork
    try:
        rundir.write_hydra_record(run_dir, cfg)  # the config as composed (a fork's steps follow from its resume=)
        rundir.write_status(run_dir, status="running")
        try:
            # a fork takes its dense phase and learning-rate schedule from its checkpoint (gatedprune.training.schedule)
            steps = {"schedule": schedule.settle(cfg, run_dir)}
            rundir.write_status(run_dir, status="running", **steps)
            session, method = _setup(cfg, run_dir)
        except (*BAD_INPUT, OmegaConfBaseException):
            if fresh:
                rundir.remove_fresh(run_dir)
                fresh = "removed"
            raise
        metrics = method.run(session)
    except SIGTERMException as err:  # fine-tuning's carries what it saved; the gated phase's is bare
        rundir.write_status(run_dir, status="interrupted", error=str(err) or "SIGTERM; the last checkpoint was saved")
        raise SystemExit(128 + signal.SIGTERM) from None
    except BaseException as err:
        if run_dir.exists() and fresh != "removed":
            rundir.write_status(run_dir, status="failed", error=one_line(f"{type(err).__name__}: {err}"))
        raise
    finally:
        _finish_wandb_run()
        rundir.unlock(held)
    rundir.write_status(run_dir, status="done", **steps)
    return metrics


def _finish_wandb_run() -> None:
    """End the W&B run that a WandbLogger started. Lightning leaves it open, and the next run in this process
    (every member of a local ``-m`` sweep) would log into it."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def _check_ddp_launch(cfg: DictConfig) -> None:
    """Lightning starts the other DDP processes by running the command line again: under ``-m`` with Hydra's
    local launcher each of them would run the whole sweep."""
    strategy = cfg.trainer.get("strategy")
    name = strategy.get("_target_") if isinstance(strategy, DictConfig) else strategy
    if "ddp" in str(name).lower() and in_sweep() and HydraConfig.get().launcher._target_.endswith("BasicLauncher"):
        raise ValueError(
            f"trainer.strategy={name} with -m: each DDP process would re-run the whole sweep; "
            "allowed: DDP in single runs (one command per value)"
        )


def _export_config(node: DictConfig) -> ExportConfig:
    """``export.*`` as an ``ExportConfig``; a config written before it had a ``_target_`` (a user's own
    ``export/*.yaml``) still composes."""
    if "_target_" in node:
        return _instantiate(node)
    try:
        return ExportConfig(**OmegaConf.to_container(node, resolve=True))
    except TypeError as err:  # an option ExportConfig does not take
        raise ValueError(f"export: {err}") from None


def _setup(cfg: DictConfig, run_dir: Path) -> tuple[Session, Method]:
    """Compose the run, the cheap checks first, so bad input fails before anything heavy runs."""
    _check_ddp_launch(cfg)
    method: Method = _instantiate(cfg.pruning)
    optim = _instantiate(cfg.optim)
    generation = _instantiate(cfg.generation)
    test_generation = _instantiate(cfg.test_generation)
    method.check_schedule(cfg.trainer.get("max_steps"))
    export = _export_config(cfg.export)
    report = speed_options(cfg.get("report"))  # report.*: what the end of the run measures (its speed-up)
    # the starting model trained on as long: the final table's fair reference (read now: a bad file fails here)
    reference = load_reference(cfg.reference) if cfg.get("reference") else None
    if reference is not None and not method.shows_reference:
        raise ValueError(f"reference={cfg.reference} with pruning={method.name}, whose table has no column for it; "
                         "allowed: null, or a gated method (pruning=l0, l0_budget, speed)")
    tuning = method.check_outputs(export, _instantiate(cfg.finetune), run_dir)
    checkpoint = checkpoints.resume_checkpoint(cfg.resume, run_dir)
    if method.needs_trained_model and checkpoint is None and cfg.model.get("name_or_path") is None:
        raise ValueError(
            f"pruning={method.name} prunes a trained model; give one: resume=<a dense run directory or its "
            "checkpoint> or model=pretrained model.name_or_path=<model directory or hub id>"
        )
    saved = checkpoints.load_checkpoint_file(checkpoint) if checkpoint else None  # refuse a truncated or unsafe file now
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # quiet: stderr is for errors until set-up is done
    # a resumed run keeps the tokenizer its checkpoint was trained with; other DDP processes take rank 0's,
    # which it saved before it started them
    tokenizer_dir = checkpoint.parents[1] / "tokenizer" if checkpoint else None
    if rank_zero_only.rank > 0:
        tokenizer_dir = run_dir / "tokenizer"
    datamodule = _instantiate(cfg.data, **({"tokenizer_path": str(tokenizer_dir)} if tokenizer_dir else {}))
    tokenizer = datamodule.prepare_tokenizer()
    if rank_zero_only.rank == 0:
        tokenizer.save_pretrained(run_dir / "tokenizer")
    model = _instantiate(cfg.model, tokenizer=tokenizer)
    export.check_model(model)  # a format that does not cover the family: refused before training
    report.check_model(model)  # a speed workload longer than the model's positions: likewise
    if checkpoint:  # a model of other shapes would fail deep inside trainer.fit, after the run directory is made
        method.check_checkpoint(checkpoint, saved)
        for field in checkpoints.check_resumable(checkpoint, saved, model, method.checkpoint_kinds(saved)):
            print(f"warning: resuming with a model config field changed: {field}")
        if method.loads_checkpoint_itself:  # trainer.fit reads the file again: free it before the module is built
            saved = None
    gating = method.gating()
    if checkpoint:  # cost fits are cached beside the checkpoint a run starts from: its forks measure once
        gating.cost_dirs.insert(0, checkpoint.parent)
    module = _instantiate(cfg.module)(model=model, tokenizer=tokenizer, pruning=gating, optim=optim,
                                      generation=generation, test_generation=test_generation)
    method.prepare(module, saved)
    del saved
    datamodule.limit_positions(model)  # validation and test pairs longer than the model's positions are cut to them
    datamodule.setup("fit")  # tokenises, and refuses a training set that length filtering emptied

    loggers = [instantiate(c) for c in cfg.logger.values()]
    resumed_here = checkpoint is not None and run_dir.resolve() in checkpoint.resolve().parents
    for logger in loggers:
        if isinstance(logger, ResumableCSVLogger):  # a run continued in its own directory keeps its earlier rows
            logger.resuming = resumed_here
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    # checkpoints written beside their target and renamed, never half a file (see AtomicCheckpointIO)
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers, callbacks=callbacks,
                                     plugins=with_atomic_checkpoints(cfg.trainer))
    method.check_trainer(trainer)
    return Session(cfg, run_dir, trainer, module, datamodule, checkpoint, tuning, export, reference), method


if __name__ == "__main__":  # python -m gatedprune.train [overrides]
    from gatedprune.cli import train_command

    train_command()
