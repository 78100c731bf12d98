"""One gated fine-tuning run: compose data, model, module, loggers and trainer from the config, fit, report."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from gatedprune import rundir
from gatedprune import checkpoints
from gatedprune.checkpoints import check_resumable, load_checkpoint_file
from gatedprune.cli import BAD_INPUT, one_line
from gatedprune.csv_logger import ResumableCSVLogger
from gatedprune.export import check_out_dir
from gatedprune.finalise import finalise
from gatedprune.head_gates import RULES
from gatedprune.finetune import FineTuneConfig
from gatedprune.lightning_module import GatedSeq2Seq
from gatedprune.methods import GatedPruning
from gatedprune import plan_run
from gatedprune.report import final_table, run_metrics
from gatedprune.utils import atomic_write_text, write_json




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

    ``<output_dir>/status.json`` says "running", then "done", "interrupted" or "failed" with the error. Bad input
    is refused during set-up, before training starts; a run directory made for this run is then removed.
    """
    run_dir = Path(cfg.paths.output_dir)
    if rank_zero_only.rank > 0:  # a DDP process started by rank 0's trainer.fit: it trains, rank 0 reports
        return _fit_and_report(cfg, run_dir, *_setup(cfg, run_dir))
    fresh = rundir.is_fresh(run_dir)  # a directory that held anything of its own is never removed
    held = rundir.lock(run_dir)  # before anything is written: another process may own this directory
    try:
        rundir.write_hydra_record(run_dir, cfg)
        rundir.write_status(run_dir, status="running")
        try:
            run = _setup(cfg, run_dir)
        except (*BAD_INPUT, OmegaConfBaseException):
            if fresh:
                rundir.remove_fresh(run_dir)
                fresh = "removed"
            raise
        metrics = _fit_and_report(cfg, run_dir, *run)
    except SIGTERMException:
        rundir.write_status(run_dir, status="interrupted", error="SIGTERM; the last checkpoint was saved")
        raise SystemExit(128 + signal.SIGTERM) from None
    except BaseException as err:
        if run_dir.exists() and fresh != "removed":
            rundir.write_status(run_dir, status="failed", error=one_line(f"{type(err).__name__}: {err}"))
        raise
    finally:
        _finish_wandb_run()
        rundir.unlock(held)
    rundir.write_status(run_dir, status="done")
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
    if "ddp" not in str(name).lower() or not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and hydra_cfg.launcher._target_.endswith("BasicLauncher"):
        raise ValueError(
            f"trainer.strategy={name} with -m: each DDP process would re-run the whole sweep; "
            "allowed: DDP in single runs (one command per value)"
        )


def _check_export_rule(rule: str, top_k) -> None:
    if rule not in RULES:
        raise ValueError(f"export.rule={rule!r}; allowed: {', '.join(RULES)}")
    if (rule == "top-k") != (top_k is not None):
        raise ValueError(f"export.rule={rule} with export.top_k={top_k}; allowed: top_k (a head count) with rule top-k only")


def _setup(cfg: DictConfig, run_dir: Path) -> tuple:
    # validate the cheap parts first, so bad input fails before anything heavy runs
    _check_ddp_launch(cfg)
    pruning = _instantiate(cfg.pruning)
    optim = _instantiate(cfg.optim)
    generation = _instantiate(cfg.generation)
    test_generation = _instantiate(cfg.test_generation)
    pruning.check_schedule(cfg.trainer.get("max_steps"))
    tuning = _instantiate(cfg.finetune)
    if tuning.distill and not pruning.distill.on:
        raise ValueError("finetune.distill=true needs a teacher: set pruning.distill.alpha or pruning.distill.hidden > 0 "
                         "(it is kept only then)")
    if not pruning.trains_gates and not cfg.export.enabled:
        raise ValueError(f"pruning={pruning.name} with export.enabled=false; allowed: export.enabled=true (its levels "
                         "are exported to <run>/levels/<heads>_heads)")
    if tuning.steps and not cfg.export.enabled:  # fine-tuning is on by default; a run that exports nothing has no model
        print(f"note: export.enabled=false: nothing is exported, so nothing is fine-tuned (finetune.steps={tuning.steps} "
              "does not apply)")
        tuning = dataclasses.replace(tuning, steps=0)
    if cfg.export.enabled and pruning.trains_gates:  # the other methods export into <run>/levels
        _check_export_rule(cfg.export.rule, cfg.export.top_k)
        check_out_dir(Path(cfg.export.out_dir), protected=[run_dir])
        if tuning.steps:
            check_out_dir(Path(tuning.out_dir), protected=[run_dir, Path(cfg.export.out_dir)])
    checkpoint = checkpoints.resume_checkpoint(cfg.resume, run_dir)
    if not pruning.trains_gates and checkpoint is None and cfg.model.get("name_or_path") is None:
        raise ValueError(
            f"pruning={pruning.name} prunes a trained model; give one: resume=<a dense run directory or its "
            "checkpoint> or model=pretrained model.name_or_path=<model directory or hub id>"
        )
    saved = load_checkpoint_file(checkpoint) if checkpoint else None  # refuse a truncated or unsafe file now
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
    if checkpoint:  # a model of other shapes would fail deep inside trainer.fit, after the run directory is made
        if not pruning.trains_gates:
            plan_run.check_dense(checkpoint, saved)
        kinds = pruning.kinds if pruning.trains_gates else saved["gate_kinds"]  # a plan method takes weights only
        for field in check_resumable(checkpoint, saved, model, kinds):
            print(f"warning: resuming with a model config field changed: {field}")
        if pruning.trains_gates:  # trainer.fit reads the checkpoint itself: free it before the module is built
            saved = None
    # a method that scores a trained model gates its heads only to mask them: the gates' own settings do not apply
    gating = pruning if pruning.trains_gates else GatedPruning(kinds=pruning.kinds, distill=pruning.distill)
    module = _instantiate(cfg.module)(model=model, tokenizer=tokenizer, pruning=gating, optim=optim,
                                      generation=generation, test_generation=test_generation)
    if not pruning.trains_gates:
        pruning.check(module.gates.num_heads)
        plan_run.load_weights(module, saved)  # the file read once; a gated run loads it in trainer.fit
    del saved
    datamodule.setup("fit")  # tokenises, and refuses a training set that length filtering emptied

    loggers = [instantiate(c) for c in cfg.logger.values()]
    resumed_here = checkpoint is not None and run_dir.resolve() in checkpoint.resolve().parents
    for logger in loggers:
        if isinstance(logger, ResumableCSVLogger):  # a run continued in its own directory keeps its earlier rows
            logger.resuming = resumed_here
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers, callbacks=callbacks)
    if not pruning.trains_gates and trainer.world_size > 1:
        raise ValueError(f"pruning={pruning.name} runs in one process; allowed: trainer.devices=1 (got "
                         f"{trainer.world_size} processes)")
    return trainer, module, datamodule, checkpoint, tuning, pruning


def _fit_and_report(
    cfg: DictConfig, run_dir: Path, trainer: L.Trainer, module: GatedSeq2Seq, datamodule, checkpoint: Path | None,
    tuning: FineTuneConfig, method,
) -> dict:
    if not method.trains_gates:  # it scores the trained model: nothing to fit
        return plan_run.run(cfg, run_dir, method, module, datamodule, tuning, checkpoint, trainer.strategy.root_device)
    if checkpoint:
        print(f"resuming from {checkpoint}")
    start = time.perf_counter()
    # weights_only: Lightning unpickles only tensors and plain data, so a checkpoint cannot run code on resume
    trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint, weights_only=True)
    seconds = {"method": time.perf_counter() - start}  # training (of this process: a resumed run counts its own part)
    final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]  # the gated model
    if not trainer.is_global_zero:
        return {}

    val_pairs = datamodule.pairs["validation"][: cfg.export.samples]
    atomic_write_text(
        run_dir / "val_pairs.jsonl", "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in val_pairs)
    )
    report = dict(seed=cfg.seed, checkpoint=str(run_dir / "checkpoints" / "last.ckpt"), head_budget=cfg.get("head_budget"))
    # the gated model's numbers, kept if the export fails; replaced by the shipped model's when it succeeds
    interim = {"note": "the gated model before export; the test split is scored after the export (see status.json)"}
    write_json(run_dir / "metrics.json", run_metrics(module, trainer, final, **report, test=interim))
    shipped = finalise(cfg, module, datamodule, tuning, val_pairs, run_dir, trainer.strategy.root_device)
    metrics = run_metrics(module, trainer, final, **report, **shipped)
    metrics["seconds"] = {**seconds, "run": time.perf_counter() - start}
    write_json(run_dir / "metrics.json", metrics)
    print(final_table(metrics))
    return metrics


if __name__ == "__main__":  # python -m gatedprune.train [overrides]
    from gatedprune.cli import train_command

    train_command()
