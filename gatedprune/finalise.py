"""After training, the model a run ships: export the plan, reload the export as a user would and score it there
(validation, and the test split beside the dense model's), fine-tune it if asked.

Returns what ``report.run_metrics`` reports; nothing here decides what goes (the method did) or cuts (surgery does).
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
    def score_on(model, split: str) -> dict:
        return module.score_split(model, split, datamodule)

    has_test = "test" in datamodule.datasets
    test = {"dense": module.dense_test} if module.dense_test is not None else {}
    if not module.gates_trained:  # a dense baseline: its final model is the dense model
        test = {"dense": module.score_test("the end of the run")}
    export = exported = finetuned = None
    if cfg.export.enabled:
        rule, top_k = module.pruning.export_rule(module.budget)  # a head budget is met exactly: top-k per group
        if rule == "binary" and cfg.export.rule != "binary":  # export.rule=top-k export.top_k=N overrides the gates'
            rule, top_k = cfg.export.rule, cfg.export.top_k
        export = export_gated(module.model, module.gates, cfg.export.out_dir, module.tokenizer, rule=rule,
                              top_k=top_k, sample_inputs=val_pairs, overwrite=_inside(cfg.export.out_dir, run_dir))
        export["dir"] = str(cfg.export.out_dir)
        # the numbers users will see for the model they ship: reloaded from its directory, as they will load it
        pruned = load_pruned(cfg.export.out_dir).to(device)
        exported = score_on(pruned, "validation")
        if module.gates_trained and has_test:
            test["pruned"] = score_on(pruned, "test")
        if tuning.steps:
            finetuned = _finetune(cfg, module, datamodule, pruned, tuning, score_on, run_dir, device)
            finetuned["validation_before"] = {k: exported[k] for k in ("bleu", "chrf", "loss")}
            exported = finetuned.pop("validation")
            if "test" in finetuned:
                test["pruned_before_finetune"], test["pruned"] = test.get("pruned"), finetuned.pop("test")
    elif module.gates_trained and has_test:
        module.gates.set_mode(module._eval_gate_mode())
        test["gated"] = score_on(module.model, "test")
    test = {k: v for k, v in test.items() if v is not None}
    return {"export": export, "exported": exported, "test": test or None, "finetuned": finetuned}


def _inside(path, run_dir: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(run_dir).resolve())


def _finetune(cfg: DictConfig, module: GatedSeq2Seq, datamodule, pruned, tuning: FineTuneConfig, score_on,
              run_dir: Path, device: torch.device) -> dict:
    """Fine-tune the exported model (one device, no gates), write it to ``finetune.out_dir``, reload and score it."""
    trainer = instantiate(cfg.trainer, max_steps=tuning.steps, devices=1, strategy="auto", num_nodes=1, logger=False,
                          callbacks=[], enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    teacher = module.teacher if tuning.distill else None
    tuned = finetune(pruned, datamodule, tuning, trainer, module.optim.label_smoothing, teacher, module.pruning.distill)
    save_pruned(tuned, tuning.out_dir, module.tokenizer, overwrite=_inside(tuning.out_dir, run_dir))
    reloaded = load_pruned(tuning.out_dir).to(device)
    result = {"dir": str(tuning.out_dir), "steps": tuning.steps, "lr": tuning.lr, "distill": tuning.distill,
              "validation": score_on(reloaded, "validation")}
    if module.gates_trained and "test" in datamodule.datasets:
        result["test"] = score_on(reloaded, "test")
    return result
