"""One gated fine-tuning run: compose data, model, module, loggers and trainer from the config, fit, report."""

from __future__ import annotations

import json
import os
import platform
import signal
from pathlib import Path

import lightning as L
import torch
import transformers
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from gatedprune.export import export_gated
from gatedprune.module import GatedSeq2Seq
from gatedprune.sweep import budget_objective
from gatedprune.utils import atomic_write_text, format_table


def train(cfg: DictConfig) -> dict:
    """Run ``cfg`` to the end; returns the metrics that are also written to ``<output_dir>/metrics.json``.

    ``<output_dir>/status.json`` says "running", then "done", or "failed" with the error, for sweep summaries.
    """
    run_dir = Path(cfg.paths.output_dir)
    _write_status(run_dir, status="running")
    try:
        metrics = _train(cfg, run_dir)
    except SIGTERMException:
        _write_status(run_dir, status="interrupted", error="SIGTERM; the last checkpoint was saved")
        raise SystemExit(128 + signal.SIGTERM) from None
    except BaseException as err:
        _write_status(run_dir, status="failed", error=f"{type(err).__name__}: {err}".splitlines()[0])
        raise
    _write_status(run_dir, status="done")
    return metrics


def _write_status(run_dir: Path, **status) -> None:
    atomic_write_text(run_dir / "status.json", json.dumps(status) + "\n")


def _train(cfg: DictConfig, run_dir: Path) -> dict:
    # validate the cheap parts first, so bad input fails before anything heavy runs
    pruning = instantiate(cfg.pruning, _convert_="all")
    optim = instantiate(cfg.optim, _convert_="all")
    generation = instantiate(cfg.generation, _convert_="all")
    L.seed_everything(cfg.seed, workers=True)

    checkpoint = resume_checkpoint(cfg.resume, run_dir)
    # a resumed run keeps the tokenizer its checkpoint was trained with
    resumed_tokenizer = {"tokenizer_path": str(checkpoint.parents[1] / "tokenizer")} if checkpoint else {}
    datamodule = instantiate(cfg.data, _convert_="all", **resumed_tokenizer)
    tokenizer = datamodule.prepare_tokenizer()
    tokenizer.save_pretrained(run_dir / "tokenizer")
    model = instantiate(cfg.model, tokenizer=tokenizer, _convert_="all")
    module = GatedSeq2Seq(model, tokenizer, pruning, optim, generation, output_dir=run_dir)

    loggers = [instantiate(c) for c in cfg.logger.values()]
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers, callbacks=callbacks)
    if checkpoint:
        print(f"resuming from {checkpoint}")
    trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]

    metrics = {
        "bleu": final["val/bleu"],
        "chrf": final["val/chrf"],
        "val_loss": final["val/loss"],
        "heads_total": module.heads_total()["total"],
        "heads_alive": module.gates.heads_alive(),
        "expected_open": final["val/expected_open"],
        "l0_lambda": pruning.l0_lambda,
        "penalty_normalisation": pruning.penalty_normalisation,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "dense": module.dense_metrics,
        "steps": trainer.global_step,
        "plan": module.gates.plan(),
        "sacrebleu_signature": module.signature,
        "seed": cfg.seed,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lightning": L.__version__,
        },
    }
    metrics["bleu_under_budget"] = budget_objective(metrics, cfg.get("head_budget"))
    val_pairs = datamodule.pairs["validation"][: cfg.export.samples]
    atomic_write_text(
        run_dir / "val_pairs.jsonl", "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in val_pairs)
    )
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    if cfg.export.enabled:
        report = export_gated(
            model, module.gates, cfg.export.out_dir, tokenizer, rule=cfg.export.rule, top_k=cfg.export.top_k,
            sample_inputs=val_pairs,
        )
        metrics["export"] = {
            "dir": str(cfg.export.out_dir),
            "params": report["params_after"],
            "verification": report["verification"],
        }
        atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    print(final_table(metrics, module.heads_total()))
    return metrics


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``resume`` is "auto" (this run dir's last checkpoint, if there is one),
    None/false (start afresh), a run directory or a checkpoint file inside one (``<run>/checkpoints/*.ckpt``)."""
    if resume in (None, False, "none", "false"):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return last if last.is_file() else None
    path = Path(resume)
    checkpoint = path / "checkpoints" / "last.ckpt" if path.is_dir() else path
    if not checkpoint.is_file():
        raise ValueError(f"resume={resume!r}: no checkpoint at {checkpoint}; give a run directory or a .ckpt file")
    if not (checkpoint.parents[1] / "tokenizer").is_dir():
        raise ValueError(f"resume={resume!r}: {checkpoint} is not inside a run directory (no tokenizer/ beside it)")
    return checkpoint


def final_table(metrics: dict, heads_total: dict) -> str:
    dense = metrics["dense"]
    rows = [("validation BLEU", f"{metrics['bleu']:.2f}"), ("validation chrF", f"{metrics['chrf']:.2f}")]
    if dense:
        rows.append((f"dense phase (step {dense['step']}) BLEU / chrF", f"{dense['bleu']:.2f} / {dense['chrf']:.2f}"))
    for kind, total in heads_total.items():
        rows.append((f"heads alive: {kind}", f"{metrics['heads_alive'].get(kind, total)} / {total}"))
    rows += [
        ("expected open heads", f"{metrics['expected_open']:.1f}"),
        ("parameters", f"{metrics['params']:,}"),
        ("l0_lambda / normalisation", f"{metrics['l0_lambda']} / {metrics['penalty_normalisation']}"),
        ("steps", str(metrics["steps"])),
        ("checkpoint", metrics["checkpoint"]),
    ]
    if "export" in metrics:
        export, check = metrics["export"], metrics["export"]["verification"]
        rows[-3:-3] = [("parameters after pruning", f"{export['params']:,}")]
        rows += [
            ("pruned model", export["dir"]),
            ("export check: max |logit diff|, greedy identical",
             f"{check['max_abs_logit_diff']:.1e}, {check['greedy_identical']}"),
        ]
    return format_table(["", "final"], rows)


def set_offline_defaults() -> None:
    """Never reach a hub from a run unless the user says so; W&B logs offline unless WANDB_MODE is set."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
