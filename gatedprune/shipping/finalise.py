"""After training, the model a run ships: export the plan, reload the export as a user would and score it there
(validation, and the test split beside the dense model's), fine-tune it if asked.

Returns what ``reports.metrics.run_metrics`` reports; nothing here decides what goes (the method did) or cuts (surgery does).
``ship`` is the part every method shares: the gates' runs call it once, the methods that score a trained model
(``gatedprune.methods.plan_run``) once per level.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from hydra.utils import instantiate

from gatedprune.errors import RunFailed, one_line
from gatedprune.reports.speed import measure_speed, speed_options
from gatedprune.shipping.export import dense_copy, export_gated
from gatedprune.shipping.export_dir import save_pruned
from gatedprune.shipping.finetune import FineTuneCheckpoint, StepProgress, check_finite, finetune, resume_point
from gatedprune.shipping.finetune_validation import FineTuneValidation, snapshot_dir
from gatedprune.shipping.reinit import reinitialise
from gatedprune.surgery.model_loading import load_pruned
from gatedprune.training.checkpoint_io import with_atomic_checkpoints
from gatedprune.training.seq_distill import dense_model
from gatedprune.training.session import Session


def finalise(session: Session, val_pairs) -> dict:
    """``{"export", "exported", "test", "finetuned", "speed"}`` for ``run_metrics``.

    The shipped model is scored where training ran (``session.device``). Outputs inside the run directory are this
    run's own: a relaunched run replaces them.
    """
    module, datamodule, export_cfg = session.module, session.datamodule, session.export
    has_test = "test" in datamodule.datasets
    test = {"dense": module.dense_test} if module.dense_test is not None else {}
    if not module.gates_trained:  # a dense baseline: its final model is the dense model
        test = {"dense": module.score_test("the end of the run")}
    export = exported = finetuned = speed = None
    if export_cfg.enabled:
        rule, top_k = module.pruning.export_rule(module.budget)  # a head budget is met exactly: top-k per group
        # export.rule=top-k export.top_k=N overrides the gates' binary rule, never a budget's
        if module.budget is None and rule == "binary" and export_cfg.rule != "binary":
            rule, top_k = export_cfg.rule, export_cfg.top_k
        shipped = ship(session, val_pairs, rule=rule, top_k=top_k, out_dir=Path(export_cfg.out_dir),
                       finetune_dir=Path(session.tuning.out_dir), score_test=module.gates_trained and has_test)
        export, exported, finetuned = shipped["export"], shipped["exported"], shipped["finetuned"]
        test.update(shipped["test"])
        speed = measure_shipped(session, shipped)
        deployed = deploy(session, shipped, val_pairs)
    elif module.gates_trained and has_test:
        module.gates.set_mode(module._eval_gate_mode())
        test["gated"] = module.score_split(module.model, "test", datamodule)
    test = {k: v for k, v in test.items() if v is not None}
    return {"export": export, "exported": exported, "test": test or None, "finetuned": finetuned, "speed": speed,
            **({"deploy": deployed} if export_cfg.enabled and deployed else {})}


def shipped_dir(shipped: dict) -> Path:
    """Where ``ship``'s result put the model it ships: the fine-tuned one, if any (not one whose fine-tune failed)."""
    tuned = shipped["finetuned"] or {}
    return Path(tuned["dir"] if tuned.get("dir") else shipped["export"]["dir"])


def measure_shipped(session: Session, shipped: dict) -> dict | None:
    """``report.speed``: the shipped model, reloaded from its directory, timed against the gated model before pruning
    (gates removed), both on the CPU in float32 (``reports.speed.measure_speed``); None when it is off.

    Once per run, for the model the run ships: the methods that export several levels (``methods.plan_run``) call
    ``ship`` per level and measure none of them (their metrics.json has no ``speed``)."""
    options = speed_options(session.cfg.get("report"))  # checked at set-up
    if not options.speed:
        return None
    source = shipped_dir(shipped)
    dense, pruned = dense_copy(session.module.model), load_pruned(source).float().eval()
    print(f"report.speed: timing {source} against the dense model (greedy, batches {list(options.batches)})")
    return {"model": str(source), **measure_speed(dense, pruned, options)}


def deploy(session: Session, shipped: dict, val_pairs) -> dict:
    """The shipped model (the fine-tuned one, if any) converted to each of ``export.formats`` besides hf, into
    ``<export.deploy_dir>/<format>``, each verified in its runtime on the validation pairs; ``{format: report}``."""
    from gatedprune.deploy.formats import convert
    from gatedprune.shipping.export_inputs import sample_batch

    export_cfg, module = session.export, session.module
    source = shipped_dir(shipped)
    reports, batch = {}, None
    for fmt in export_cfg.deploy_formats():
        model = load_pruned(source).float().eval()  # a fresh copy for each format: none sees another's changes
        batch = batch if batch is not None else sample_batch(model, module.tokenizer, val_pairs)
        out_dir = Path(export_cfg.deploy_dir) / fmt
        # ct2: the gated model before pruning converted too, for the speed-up in CTranslate2
        options = {"quantization": export_cfg.quantization, "dense": dense_copy(module.model)} if fmt == "ct2" else {}
        try:
            report = convert(model, out_dir, fmt, tokenizer=module.tokenizer, batch=batch,
                             overwrite=_inside(out_dir, session.run_dir), **options)
        except (ValueError, RunFailed) as err:  # a plan this format cannot hold, or a check that failed: recorded
            message = one_line(str(err))
            named = fmt in message.partition(":")[0]  # the format's own errors name it first
            reports[fmt] = {"dir": None, "from": str(source), "error": message if named else f"--format {fmt}: {message}"}
            print(f"error: {reports[fmt]['error']}; nothing was written to {out_dir}")
            continue
        reports[fmt] = {"dir": str(out_dir), "from": str(source), **report}
        print(f"wrote {out_dir} ({report['runtime']}): verified, greedy identical on "
              f"{report['verification']['greedy_sequences']} validation pairs")
    return reports


def deploy_errors(shipped: dict) -> str | None:
    """The formats of ``finalise``'s result that could not be written, in one line, or None."""
    errors = [report["error"] for report in (shipped.get("deploy") or {}).values() if report.get("error")]
    return "; ".join(errors) or None


def ship(session: Session, val_pairs, *, rule: str, top_k, out_dir: Path, finetune_dir: Path,
         score_test: bool) -> dict:
    """Export what ``module.gates`` keep under ``rule`` to ``out_dir`` (verified), reload it, score it, fine-tune it
    (``tuning.steps``) into ``finetune_dir``. Returns ``{"export", "exported", "finetuned", "test"}``: ``exported``
    is the validation score of the model shipped (the fine-tuned one, if any), ``test`` its test score
    (``{"pruned"}``, and ``"pruned_before_finetune"``).

    A fine-tune that diverges writes nothing to ``finetune_dir``: the export as verified is shipped, and
    ``finetuned`` is ``{"error", ...}`` (``tuning_error``); the caller fails the run once its metrics are written."""
    module, run_dir = session.module, session.run_dir
    export = export_gated(module.model, module.gates, out_dir, module.tokenizer, rule=rule, top_k=top_k,
                          sample_inputs=val_pairs, overwrite=_inside(out_dir, run_dir))
    export["dir"] = str(out_dir)
    # the numbers users will see for the model they ship: reloaded from its directory, as they will load it
    pruned = load_pruned(out_dir).to(session.device)
    return {"export": export, **recover(session, pruned, export, finetune_dir, score_test)}


def recover(session: Session, pruned, export: dict, finetune_dir: Path, score_test: bool) -> dict:
    """Score the exported model ``pruned`` (``export``: its record, with its ``plan``) and fine-tune it
    (``tuning.steps``) into ``finetune_dir``: ``{"exported", "finetuned", "test"}`` as ``ship`` returns them. The
    part of ``ship`` that ``pruning=recover`` (``gatedprune-finetune``) runs on an export made before."""
    module, datamodule, tuning = session.module, session.datamodule, session.tuning

    def score_on(model, split: str) -> dict:
        return module.score_split(model, split, datamodule)

    exported = score_on(pruned, "validation")
    test = {"pruned": score_on(pruned, "test")} if score_test else {}
    finetuned = None
    if tuning.steps:
        try:
            finetuned = _finetune(session, pruned, export, finetune_dir, score_on, score_test)
        except FloatingPointError as err:
            return {"exported": exported, "test": test, "finetuned": _failed(session, finetune_dir, err, exported)}
        finetuned["validation_before"] = headline(exported)
        exported = finetuned.pop("validation")
        if "test" in finetuned:
            test = {"pruned_before_finetune": test.get("pruned"), "pruned": finetuned.pop("test")}
    return {"exported": exported, "finetuned": finetuned, "test": test}


def tuning_error(shipped: dict) -> str | None:
    """The one-line reason the fine-tune of ``ship``'s result failed (the export was shipped instead), or None."""
    return (shipped["finetuned"] or {}).get("error")


# metrics.json's ``model`` when the fine-tune failed: the numbers describe the export as verified
UNTUNED = "exported (fine-tuning failed: see finetune.error; the export as verified is shipped)"


def headline(result: dict) -> dict:
    """BLEU, chrF and loss of a score (``evaluate.score``'s result), without the rest."""
    return {key: result[key] for key in ("bleu", "chrf", "loss")}


def _inside(path, run_dir: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(run_dir).resolve())


def _finetune(session: Session, pruned, export: dict, out_dir: Path, score_on, score_test: bool) -> dict:
    """Fine-tune the exported model (one device, no gates), write it to ``out_dir``, reload and score it.

    SIGTERM saves ``<run>/checkpoints/finetune.ckpt``; a relaunch of the same fine-tune (same export and plan, same
    ``finetune.*``) resumes from it, and a finished fine-tune removes it. With ``finetune.val_check_interval`` the
    best validation's weights are shipped (``FineTuneValidation``), and only they are scored on the test split.
    """
    module, datamodule, tuning, run_dir = session.module, session.datamodule, session.tuning, session.run_dir
    inside = _inside(out_dir, run_dir)
    if tuning.init == "scratch":  # the pruned shapes from nothing: what pruning must beat at equal steps
        reinitialise(pruned, session.cfg.seed)
        print(f"finetune.init=scratch: every weight of {out_dir.name}'s pruned shapes drawn again (seed "
              f"{session.cfg.seed})")
    checkpoint = _checkpoint(session, out_dir)
    saver = FineTuneCheckpoint(checkpoint, every=tuning.checkpoint_every)

    def snapshot(model, step: int) -> None:
        # this fine-tune's own (<out_dir>_step<N>): a resumed fine-tune writes it again
        save_pruned(model, snapshot_dir(out_dir, step), module.tokenizer, overwrite=True)

    # before the saver, so a checkpoint of step N holds step N's validation
    validation = FineTuneValidation(lambda model: score_on(model, "validation"), tuning.val_check_interval,
                                    tuning.patience, loggers=session.trainer.loggers,
                                    offset=session.trainer.global_step, save_at=tuning.save_at, save=snapshot)
    trainer = instantiate(session.cfg.trainer, max_steps=tuning.steps, devices=1, strategy="auto", num_nodes=1,
                          logger=False, callbacks=[validation, saver, StepProgress()], enable_checkpointing=False,
                          enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0,
                          plugins=with_atomic_checkpoints(session.cfg.trainer))
    distill = module.pruning.distill
    if tuning.distill_alpha is not None:  # this phase's own weight (the gated phase's other settings)
        distill = dataclasses.replace(distill, alpha=tuning.distill_alpha)
    teacher = (module.teacher if tuning.distill else dense_model(module)) if tuning.distils else None
    dense = dense_model(module) if tuning.targets != "labels" else None  # sequence-level targets are its translations
    identity = {"dir": str(out_dir.resolve().relative_to(run_dir.resolve()) if inside else out_dir.resolve()),
                "plan": export["plan"], "steps": tuning.steps, "lr": tuning.lr, "warmup_steps": tuning.warmup_steps,
                "decay": tuning.decay, "distill": tuning.distill, "distill_alpha": tuning.distill_alpha,
                "targets": tuning.targets, "targets_max": tuning.targets_max, "init": tuning.init,
                "val_check_interval": tuning.val_check_interval, "patience": tuning.patience,
                "save_at": tuning.save_at, "seed": session.cfg.seed}
    resume = resume_point(checkpoint, identity)
    if resume:
        print(f"resuming fine-tuning from {resume}")
    timing: dict = {}
    tuned = finetune(pruned, datamodule, tuning, trainer, module.optim.label_smoothing, teacher, distill,
                     max_bad_steps=module.optim.max_bad_steps, seed=session.cfg.seed, identity=identity, resume=resume,
                     dense=dense, timing=timing)
    # the case for pruning is compute: what the phase took (the teacher's forward passes and targets included)
    wall, trained = timing["wall_s"], timing["steps"]
    per_step = wall / max(trained, 1)
    print(f"fine-tuning took {wall:.1f} s for {trained} steps ({per_step:.3f} s per step, validations included)")
    best = validation.restore_best(tuned)  # None without validation: the last step's weights are shipped
    shipped_step = best["step"] if best else trainer.global_step
    if best:
        print(f"fine-tuning ships the weights of step {shipped_step} (validation BLEU {best['bleu']:.2f}, the best "
              f"of {len(validation.curve)} validations)")
    check_finite(tuned, "the end of fine-tuning")  # weights that are not finite are never written
    save_pruned(tuned, out_dir, module.tokenizer, overwrite=inside)
    checkpoint.unlink(missing_ok=True)  # this fine-tune is done: a relaunch must not resume it
    reloaded = load_pruned(out_dir).to(session.device)
    result = {"dir": str(out_dir), "steps": tuning.steps, "steps_trained": trainer.global_step,
              "shipped_step": shipped_step, "lr": tuning.lr, "warmup_steps": tuning.warmup_steps,
              "decay": tuning.decay, "init": tuning.init, "distill": tuning.distill,
              "distill_alpha": tuning.distill_alpha, "targets": tuning.targets, "targets_max": tuning.targets_max,
              "wall_s": round(wall, 2), "steps_timed": trained, "s_per_step": round(per_step, 4),
              **(validation.record() if tuning.val_check_interval else {}),
              **({"snapshots": {step: str(snapshot_dir(out_dir, step)) for step in tuning.save_at
                                if step <= trainer.global_step}} if tuning.save_at else {}),
              "validation": score_on(reloaded, "validation")}
    if score_test:
        result["test"] = score_on(reloaded, "test")
    return result


def _checkpoint(session: Session, out_dir: Path) -> Path:
    """Where SIGTERM saves the fine-tune into ``out_dir``: ``checkpoints/finetune.ckpt`` for the run's own
    ``pruned_finetuned/``, one file per level for a method with several (``finetune-levels-012_heads.ckpt``), so a
    relaunch that fine-tunes the levels again in order resumes the one that was interrupted."""
    run_dir = Path(session.run_dir)
    default = Path(session.tuning.out_dir)
    if out_dir.resolve() == default.resolve() or not _inside(out_dir, run_dir):
        return run_dir / "checkpoints" / "finetune.ckpt"
    where = out_dir.resolve().parent.relative_to(run_dir.resolve())  # levels/012_heads/pruned_finetuned: levels/012_heads
    return run_dir / "checkpoints" / f"finetune-{'-'.join(where.parts) or 'run'}.ckpt"


def _failed(session: Session, out_dir: Path, err: FloatingPointError, exported: dict) -> dict:
    """What metrics.json keeps of a fine-tune that diverged; no fine-tuned model is left that it does not describe
    (an earlier run's ``out_dir`` inside this run directory goes too)."""
    tuning = session.tuning
    for path in [out_dir, *(snapshot_dir(out_dir, step) for step in tuning.save_at)]:
        if _inside(path, session.run_dir) and path.exists():
            shutil.rmtree(path)
    _checkpoint(session, out_dir).unlink(missing_ok=True)
    error = one_line(str(err))
    print(f"{error}; nothing was written to {out_dir}: the export as verified is what this run ships")
    return {"error": error, "dir": None, "steps": tuning.steps, "lr": tuning.lr, "distill": tuning.distill,
            "targets": tuning.targets,
            "validation_before": headline(exported)}
