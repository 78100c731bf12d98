"""After training, the model a run ships: export the plan, reload the export as a user would and score it there
(validation, and the test split beside the dense model's), fine-tune it if asked.

Returns what ``report.run_metrics`` reports; nothing here decides what goes (the method did) or cuts (surgery does).
``ship`` is the part every method shares: the gates' runs call it once, the methods that score a trained model
(``gatedprune.methods.plan_run``) once per level.
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate

from gatedprune.shipping.export import export_gated
from gatedprune.shipping.export_dir import save_pruned
from gatedprune.shipping.finetune import finetune
from gatedprune.surgery.model_loading import load_pruned
from gatedprune.training.session import Session


def finalise(session: Session, val_pairs) -> dict:
    """``{"export", "exported", "test", "finetuned"}`` for ``run_metrics``.

    The shipped model is scored where training ran (``session.device``). Outputs inside the run directory are this
    run's own: a relaunched run replaces them.
    """
    module, datamodule, export_cfg = session.module, session.datamodule, session.export
    has_test = "test" in datamodule.datasets
    test = {"dense": module.dense_test} if module.dense_test is not None else {}
    if not module.gates_trained:  # a dense baseline: its final model is the dense model
        test = {"dense": module.score_test("the end of the run")}
    export = exported = finetuned = None
    if export_cfg.enabled:
        rule, top_k = module.pruning.export_rule(module.budget)  # a head budget is met exactly: top-k per group
        if rule == "binary" and export_cfg.rule != "binary":  # export.rule=top-k export.top_k=N overrides the gates'
            rule, top_k = export_cfg.rule, export_cfg.top_k
        shipped = ship(session, val_pairs, rule=rule, top_k=top_k, out_dir=Path(export_cfg.out_dir),
                       finetune_dir=Path(session.tuning.out_dir), score_test=module.gates_trained and has_test)
        export, exported, finetuned = shipped["export"], shipped["exported"], shipped["finetuned"]
        test.update(shipped["test"])
    elif module.gates_trained and has_test:
        module.gates.set_mode(module._eval_gate_mode())
        test["gated"] = module.score_split(module.model, "test", datamodule)
    test = {k: v for k, v in test.items() if v is not None}
    return {"export": export, "exported": exported, "test": test or None, "finetuned": finetuned}


def ship(session: Session, val_pairs, *, rule: str, top_k, out_dir: Path, finetune_dir: Path,
         score_test: bool) -> dict:
    """Export what ``module.gates`` keep under ``rule`` to ``out_dir`` (verified), reload it, score it, fine-tune it
    (``tuning.steps``) into ``finetune_dir``. Returns ``{"export", "exported", "finetuned", "test"}``: ``exported``
    is the validation score of the model shipped (the fine-tuned one, if any), ``test`` its test score
    (``{"pruned"}``, and ``"pruned_before_finetune"``)."""
    module, datamodule, tuning, run_dir, device = (session.module, session.datamodule, session.tuning,
                                                   session.run_dir, session.device)

    def score_on(model, split: str) -> dict:
        return module.score_split(model, split, datamodule)

    export = export_gated(module.model, module.gates, out_dir, module.tokenizer, rule=rule, top_k=top_k,
                          sample_inputs=val_pairs, overwrite=_inside(out_dir, run_dir))
    export["dir"] = str(out_dir)
    # the numbers users will see for the model they ship: reloaded from its directory, as they will load it
    pruned = load_pruned(out_dir).to(device)
    exported = score_on(pruned, "validation")
    test = {"pruned": score_on(pruned, "test")} if score_test else {}
    finetuned = None
    if tuning.steps:
        finetuned = _finetune(session, pruned, finetune_dir, score_on, score_test)
        finetuned["validation_before"] = headline(exported)
        exported = finetuned.pop("validation")
        if "test" in finetuned:
            test = {"pruned_before_finetune": test.get("pruned"), "pruned": finetuned.pop("test")}
    return {"export": export, "exported": exported, "finetuned": finetuned, "test": test}


def headline(result: dict) -> dict:
    """BLEU, chrF and loss of a score (``evaluate.score``'s result), without the rest."""
    return {key: result[key] for key in ("bleu", "chrf", "loss")}


def _inside(path, run_dir: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(run_dir).resolve())


def _finetune(session: Session, pruned, out_dir: Path, score_on, score_test: bool) -> dict:
    """Fine-tune the exported model (one device, no gates), write it to ``out_dir``, reload and score it."""
    module, datamodule, tuning, run_dir = session.module, session.datamodule, session.tuning, session.run_dir
    trainer = instantiate(session.cfg.trainer, max_steps=tuning.steps, devices=1, strategy="auto", num_nodes=1, logger=False,
                          callbacks=[], enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    teacher = module.teacher if tuning.distill else None
    tuned = finetune(pruned, datamodule, tuning, trainer, module.optim.label_smoothing, teacher, module.pruning.distill)
    save_pruned(tuned, out_dir, module.tokenizer, overwrite=_inside(out_dir, run_dir))
    reloaded = load_pruned(out_dir).to(session.device)
    result = {"dir": str(out_dir), "steps": tuning.steps, "lr": tuning.lr, "distill": tuning.distill,
              "validation": score_on(reloaded, "validation")}
    if score_test:
        result["test"] = score_on(reloaded, "test")
    return result
