"""After training, the model a run ships: export the plan, reload the export as a user would and score it there
(validation, and the test split beside the dense model's), fine-tune it if asked.

Returns what ``report.run_metrics`` reports; nothing here decides what goes (the method did) or cuts (surgery does).
``ship`` is the part every method shares: the gates' runs call it once, the methods that score a trained model
(``gatedprune.plan_run``) once per level.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from gatedprune.export import export_gated
from gatedprune.export_dir import save_pruned
from gatedprune.finetune import FineTuneConfig, finetune
from gatedprune.lightning_module import GatedSeq2Seq
from gatedprune.surgery import load_pruned


def finalise(cfg: DictConfig, module: GatedSeq2Seq, datamodule, tuning: FineTuneConfig, val_pairs, run_dir: Path,
             device: torch.device) -> dict:
    """``{"export", "exported", "test", "finetuned"}`` for ``run_metrics``; ``cfg`` gives ``export`` and ``trainer``.

    ``device``: where training ran (Lightning moves the module to the CPU when it tears down); the shipped model is
    scored there. Outputs inside ``run_dir`` are this run's own: a relaunched run replaces them.
    """
    has_test = "test" in datamodule.datasets
    test = {"dense": module.dense_test} if module.dense_test is not None else {}
    if not module.gates_trained:  # a dense baseline: its final model is the dense model
        test = {"dense": module.score_test("the end of the run")}
    export = exported = finetuned = None
    if cfg.export.enabled:
        rule, top_k = module.pruning.export_rule(module.budget)  # a head budget is met exactly: top-k per group
        if rule == "binary" and cfg.export.rule != "binary":  # export.rule=top-k export.top_k=N overrides the gates'
            rule, top_k = cfg.export.rule, cfg.export.top_k
        shipped = ship(cfg, module, datamodule, tuning, val_pairs, run_dir, device, rule=rule, top_k=top_k,
                       out_dir=Path(cfg.export.out_dir), finetune_dir=Path(tuning.out_dir),
                       score_test=module.gates_trained and has_test)
        export, exported, finetuned = shipped["export"], shipped["exported"], shipped["finetuned"]
        test.update(shipped["test"])
    elif module.gates_trained and has_test:
        module.gates.set_mode(module._eval_gate_mode())
        test["gated"] = module.score_split(module.model, "test", datamodule)
    test = {k: v for k, v in test.items() if v is not None}
    return {"export": export, "exported": exported, "test": test or None, "finetuned": finetuned}


def ship(cfg: DictConfig, module: GatedSeq2Seq, datamodule, tuning: FineTuneConfig, val_pairs, run_dir: Path,
         device: torch.device, *, rule: str, top_k, out_dir: Path, finetune_dir: Path, score_test: bool) -> dict:
    """Export what ``module.gates`` keep under ``rule`` to ``out_dir`` (verified), reload it, score it, fine-tune it
    (``tuning.steps``) into ``finetune_dir``. Returns ``{"export", "exported", "finetuned", "test"}``: ``exported``
    is the validation score of the model shipped (the fine-tuned one, if any), ``test`` its test score
    (``{"pruned"}``, and ``"pruned_before_finetune"``)."""
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
        finetuned = _finetune(cfg, module, datamodule, pruned, tuning, finetune_dir, score_on, run_dir, device,
                              score_test)
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


def _finetune(cfg: DictConfig, module: GatedSeq2Seq, datamodule, pruned, tuning: FineTuneConfig, out_dir: Path,
              score_on, run_dir: Path, device: torch.device, score_test: bool) -> dict:
    """Fine-tune the exported model (one device, no gates), write it to ``out_dir``, reload and score it."""
    trainer = instantiate(cfg.trainer, max_steps=tuning.steps, devices=1, strategy="auto", num_nodes=1, logger=False,
                          callbacks=[], enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    teacher = module.teacher if tuning.distill else None
    tuned = finetune(pruned, datamodule, tuning, trainer, module.optim.label_smoothing, teacher, module.pruning.distill)
    save_pruned(tuned, out_dir, module.tokenizer, overwrite=_inside(out_dir, run_dir))
    reloaded = load_pruned(out_dir).to(device)
    result = {"dir": str(out_dir), "steps": tuning.steps, "lr": tuning.lr, "distill": tuning.distill,
              "validation": score_on(reloaded, "validation")}
    if score_test:
        result["test"] = score_on(reloaded, "test")
    return result
