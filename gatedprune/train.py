"""One gated fine-tuning run: compose data, model, module, loggers and trainer from the config, fit, report."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import lightning as L
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import DictConfig

from gatedprune.module import GatedSeq2Seq
from gatedprune.utils import atomic_write_text, format_table


def train(cfg: DictConfig) -> dict:
    """Run ``cfg`` to the end; returns the metrics that are also written to ``<output_dir>/metrics.json``."""
    run_dir = Path(cfg.paths.output_dir)
    # validate the cheap parts first, so bad input fails before anything heavy runs
    pruning = instantiate(cfg.pruning, _convert_="all")
    optim = instantiate(cfg.optim, _convert_="all")
    generation = instantiate(cfg.generation, _convert_="all")
    L.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data, _convert_="all")
    tokenizer = datamodule.prepare_tokenizer()
    tokenizer.save_pretrained(run_dir / "tokenizer")
    model = instantiate(cfg.model, tokenizer=tokenizer, _convert_="all")
    module = GatedSeq2Seq(model, tokenizer, pruning, optim, generation, output_dir=run_dir)

    loggers = [instantiate(c) for c in cfg.logger.values()]
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers, callbacks=callbacks)
    trainer.fit(module, datamodule=datamodule)
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
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    print(final_table(metrics, module.heads_total()))
    return metrics


def final_table(metrics: dict, heads_total: dict) -> str:
    dense = metrics["dense"]
    rows = [("validation BLEU", f"{metrics['bleu']:.2f}"), ("validation chrF", f"{metrics['chrf']:.2f}")]
    if dense:
        rows.append((f"dense phase (step {dense['step']}) BLEU / chrF", f"{dense['bleu']:.2f} / {dense['chrf']:.2f}"))
    for kind, total in heads_total.items():
        rows.append((f"heads alive: {kind}", f"{metrics['heads_alive'].get(kind, total)} / {total}"))
    rows += [
        ("expected open heads", f"{metrics['expected_open']:.1f}"),
        ("parameters (unpruned)", f"{metrics['params']:,}"),
        ("l0_lambda / normalisation", f"{metrics['l0_lambda']} / {metrics['penalty_normalisation']}"),
        ("steps", str(metrics["steps"])),
        ("checkpoint", metrics["checkpoint"]),
    ]
    return format_table(["", "final"], rows)


def set_offline_defaults() -> None:
    """Never reach a hub from a run unless the user says so; W&B logs offline unless WANDB_MODE is set."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
