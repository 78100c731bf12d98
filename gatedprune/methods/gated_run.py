"""A run of a method that trains gates (``gatedprune.methods.gated``): fit, then ship the plan their rule keeps.

The gated model is validated once more after training, its numbers written to ``metrics.json`` (kept if the
export fails), then ``shipping.finalise`` exports, verifies, reloads, scores and fine-tunes it, and ``metrics.json``
describes the model shipped.
"""

from __future__ import annotations

import json
import time

from gatedprune.errors import RunFailed
from gatedprune.reports.metrics import final_table, run_metrics
from gatedprune.reports.reference import reference_at
from gatedprune.shipping.finalise import UNTUNED, deploy_errors, finalise, tuning_error
from gatedprune.training.session import Session
from gatedprune.utils import atomic_write_text, write_json


def fit_and_ship(method, session: Session) -> dict:
    """Train the gates of ``session.module`` (resuming ``session.checkpoint``), then ship; returns the metrics
    (rank 0; {} in the other DDP processes, which only train)."""
    trainer, module, datamodule, run_dir = session.trainer, session.module, session.datamodule, session.run_dir
    if session.checkpoint:
        print(f"resuming from {session.checkpoint}")
    start = time.perf_counter()
    # weights_only: Lightning unpickles only tensors and plain data, so a checkpoint cannot run code on resume
    trainer.fit(module, datamodule=datamodule, ckpt_path=session.checkpoint, weights_only=True)
    seconds = {"method": time.perf_counter() - start}  # training (of this process: a resumed run counts its own part)
    # the case for pruning is compute: the dense and gated steps this process trained, validations included
    trained = trainer.global_step - getattr(module, "first_step", 0)
    seconds.update(steps_timed=trained, s_per_step=round(seconds["method"] / max(trained, 1), 4))
    final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]  # the gated model
    if not trainer.is_global_zero:
        return {}

    val_pairs = datamodule.pairs["validation"][: session.export.samples]
    atomic_write_text(
        run_dir / "val_pairs.jsonl", "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in val_pairs)
    )
    cfg = session.cfg
    # the checkpoint relative to the run directory: a copy of the run then names its own file, not this one
    report = dict(seed=cfg.seed, checkpoint="checkpoints/last.ckpt", head_budget=cfg.get("head_budget"))
    # the gated model's numbers, kept if the export fails; replaced by the shipped model's when it succeeds
    interim = {"note": "the gated model before export; the test split is scored after the export (see status.json)"}
    write_json(run_dir / "metrics.json", run_metrics(module, trainer, final, **report, test=interim))
    shipped = finalise(session, val_pairs)
    failed = shipped["finetuned"] if tuning_error(shipped) else None
    if failed:  # the fine-tune diverged: the export as verified is what the run ships, and metrics.json says so
        shipped["finetuned"] = None
    metrics = run_metrics(module, trainer, final, **report, **shipped)
    metrics["seconds"] = {**seconds, "run": time.perf_counter() - start}
    if session.reference is not None:  # the starting model trained on for this run's steps: gated, then fine-tuned
        tuned = (shipped["finetuned"] or {}).get("steps_trained", 0)
        gated = trainer.global_step - int(cfg.pruning.start_step)  # as trained: stop_when_stable may end it early
        metrics["reference"] = reference_at(session.reference, gated + tuned)
    table = final_table(metrics)  # of the models there are: no fine-tuned one if it failed
    if failed:
        metrics.update(model=UNTUNED, finetune=failed)
    write_json(run_dir / "metrics.json", metrics)
    print(table)
    if failed:
        raise RunFailed(f"{failed['error']}; shipped {metrics['export']['dir']} as exported and verified (metrics.json "
                        "describes it), no fine-tuned model was written")
    undeployed = deploy_errors(shipped)
    if undeployed:
        raise RunFailed(f"{undeployed}; the Hugging Face export is shipped and verified (metrics.json describes it)")
    return metrics
