"""``pruning=recover``: fine-tune a model pruned before (an export directory) back toward its teacher.

Nothing is gated, scored for importance or cut: the plan was decided and applied when the export was made (by any
method, or by ``gatedprune-export``). The run's model (``model=teacher``, or ``model=pretrained
model.name_or_path=<dense model>``) is the teacher: the dense model whose translations (``finetune.targets``) and
outputs (``finetune.distill``) the export learns from, and the reference its numbers are shown beside. The export
goes through the same fine-tuning, validation, reload and scoring as a gated run's export (``finalise.recover``);
``gatedprune-finetune PRUNED_DIR --teacher DIR`` is this method from the command line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from gatedprune.methods.base import Method
from gatedprune.methods.gated import GatedPruning
from gatedprune.utils import format_table, write_json


@dataclass
class Recover(Method):
    """Fine-tune the export in ``pruned`` (a directory ``load_pruned`` reads) with ``finetune.*``."""

    name: ClassVar[str] = "recover"
    needs_trained_model: ClassVar[bool] = True  # the teacher
    pruned: str | None = None

    def check_outputs(self, export, tuning, run_dir: Path):
        if not self.pruned:
            raise ValueError("pruning=recover needs the export to fine-tune: pruning.pruned=<a directory written by "
                             "gatedprune (its config.json has a gatedprune plan)>")
        config = Path(self.pruned) / "config.json"
        try:
            plan = json.loads(config.read_text()).get("gatedprune")
        except (OSError, ValueError):
            plan = None
        if not isinstance(plan, dict):
            raise ValueError(f"pruning.pruned={self.pruned}: not a pruned export (no config.json with a gatedprune "
                             "plan); allowed: a directory written by a gatedprune run, gatedprune-export or "
                             "gatedprune-finetune")
        if not tuning.steps:
            raise ValueError("pruning=recover with finetune.steps=0: nothing to do; allowed: finetune.steps >= 1")
        if not export.enabled:
            raise ValueError("pruning=recover with export.enabled=false: the fine-tuned export is what it writes; "
                             "allowed: export.enabled=true")
        if export.deploy_formats():
            raise ValueError(f"export.formats={list(export.formats)} with pruning=recover; allowed: [hf] (convert "
                             "the result with gatedprune-export)")
        self.plan = plan
        return super().check_outputs(export, tuning, run_dir)

    def gating(self) -> GatedPruning:
        # the teacher is gated only because every run's module is; its gates stay open and nothing trains them
        return GatedPruning(kinds=self.kinds, distill=self.distill)

    def prepare(self, module, saved: dict | None) -> None:
        from gatedprune.methods.plan_run import load_weights

        load_weights(module, saved)  # resume=<dense run>: its weights; model=teacher/pretrained: as loaded

    def run(self, session) -> dict:
        from gatedprune.shipping.finalise import measure_shipped, recover, tuning_error
        from gatedprune.errors import RunFailed
        from gatedprune.surgery.model_loading import load_pruned

        started = time.perf_counter()
        module, datamodule, run_dir = session.module, session.datamodule, session.run_dir
        module.to(session.device)
        module.gates.set_mode("open")
        teacher = module.model.eval()
        pruned = load_pruned(self.pruned).to(session.device)
        _check_vocabulary(pruned, module.tokenizer, self.pruned)
        has_test = module.test_generation is not None and "test" in datamodule.datasets
        dense = {"validation": module.score_split(teacher, "validation", datamodule),
                 "test": module.score_split(teacher, "test", datamodule) if has_test else None}
        print(f"the teacher: validation BLEU {dense['validation']['bleu']:.2f}"
              + (f", test BLEU {dense['test']['bleu']:.2f}" if has_test else ""))
        export = {"dir": str(self.pruned), "plan": self.plan}
        shipped = recover(session, pruned, export, Path(session.tuning.out_dir), has_test)
        failed = tuning_error(shipped)
        shipped["export"] = export
        speed = None if failed else measure_shipped(session, shipped)
        metrics = {"method": self.name, "pruned": str(self.pruned), "teacher": _teacher_name(session),
                   "model": str(shipped["finetuned"]["dir"]) if not failed else None,
                   "bleu": shipped["exported"]["bleu"], "chrf": shipped["exported"]["chrf"],
                   "val_loss": shipped["exported"]["loss"], "dense": dense, "test": shipped["test"],
                   "finetune": shipped["finetuned"], "speed": speed, "seed": session.cfg.seed,
                   "params": sum(p.numel() for p in pruned.parameters()),
                   "params_before": sum(p.numel() for p in teacher.parameters()),
                   "seconds": {"run": time.perf_counter() - started}}
        write_json(run_dir / "metrics.json", metrics)
        print(recover_table(metrics))
        if failed:
            raise RunFailed(f"{failed}; nothing was written to {session.tuning.out_dir}")
        return metrics


def _teacher_name(session) -> str | None:
    return session.cfg.model.get("name_or_path") or (str(session.checkpoint) if session.checkpoint else None)


def _check_vocabulary(pruned, tokenizer, path) -> None:
    """The export must read the teacher's tokens: the data is tokenised with the teacher's tokenizer."""
    rows = pruned.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise ValueError(f"pruning.pruned={path}: its embeddings have {rows} rows, the teacher's tokenizer "
                         f"{len(tokenizer)} tokens; allowed: an export of this teacher (the same vocabulary)")


def recover_table(metrics: dict) -> str:
    """The teacher, the export as given and the fine-tuned export: BLEU and chrF on validation and test."""
    test, tuned = metrics["test"] or {}, metrics["finetune"] or {}
    columns = {"teacher": (metrics["dense"]["validation"], metrics["dense"]["test"]),
               "export": (tuned.get("validation_before"), test.get("pruned_before_finetune", test.get("pruned")))}
    if tuned.get("dir"):
        columns[f"fine-tuned (step {tuned['shipped_step']} of {tuned['steps_trained']})"] = (
            {"bleu": metrics["bleu"], "chrf": metrics["chrf"]}, test.get("pruned"))

    def cell(score, key):
        return "-" if not score else f"{score[key]:.2f}"

    rows = [(f"{split} {key}", *(cell(pair[i], key) for pair in columns.values()))
            for i, split in enumerate(("validation", "test")) for key in ("bleu", "chrf")]
    rows = [(name.replace("bleu", "BLEU").replace("chrf", "chrF"), *rest) for name, *rest in rows]
    rows.append(("parameters", f"{metrics['params_before']:,}", f"{metrics['params']:,}", f"{metrics['params']:,}"
                 if tuned.get("dir") else None))
    return format_table(["", *columns], [tuple(c for c in row if c is not None) for row in rows])
