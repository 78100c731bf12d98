"""A run of a method that scores a trained model (``gatedprune.methods.baselines``): levels -> export -> report.

The model comes from ``resume=`` (a dense run or its checkpoint: its weights; any gates in it are ignored) or from
``model=pretrained``. The method asks a ``MaskedModel`` what it needs (loss, BLEU, importance with some heads
masked) and returns its levels. The levels it exports (all, or those it chooses by their masked validation BLEU)
go through the same export, verification, reload, test scoring and fine-tuning as a gated run's
(``finalise.ship``), each into ``<run>/levels/<heads>_heads/`` (``<unit>_<fraction>/``, ``params_0.5/``, for a
level drawn at a cost budget, which names its whole plan) with its own ``metrics.json``. The run's ``metrics.json``
describes the last level exported (the fewest heads, or the smallest budget) and lists every level.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from gatedprune.training.checkpoints import strip_prefix
from gatedprune.reports.scoring import corpus_scores, generate, token_cross_entropy
from gatedprune.errors import RunFailed
from gatedprune.shipping.finalise import UNTUNED, headline, ship, tuning_error
from gatedprune.methods.base import Method
from gatedprune.methods.importance import head_importance
from gatedprune.methods.levels import Head, Level
from gatedprune.structures.head_gates import COST_UNITS
from gatedprune.structures.kinds import ATTENTION_KINDS
from gatedprune.training.module import GatedSeq2Seq
from gatedprune.training.session import Session
from gatedprune.reports.metrics import checkpoint_record, export_plan, exported_structures, heads_in_model, heads_kept
from gatedprune.versions import versions
from gatedprune.utils import format_table, write_json



class MaskedModel:
    """The trained model with every gated head behind a fixed 0/1 gate: what a plan keeps, computed without cutting.

    ``loss`` and ``bleu`` use a fixed validation subset (whole batches, shortest sources first, until at least
    ``eval_pairs`` pairs),
    ``importance`` the same batches; ``evaluations`` counts the model evaluations asked for.
    """

    def __init__(self, module: GatedSeq2Seq, datamodule, eval_pairs: int, device: torch.device):
        self.module, self.model, self.gates = module, module.model.eval(), module.gates  # on ``device`` already
        # heads only: the methods that score a model score heads (a random draw of other kinds names its whole plan)
        self.heads: list[Head] = [(path, head) for path, kind, _, head in self.gates.index() if kind in ATTENTION_KINDS]
        self.attention = [path for path, kind in zip(self.gates.paths, self.gates.kinds) if kind in ATTENTION_KINDS]
        self.device = device
        batches, taken = [], 0
        for batch in datamodule.loader("validation", shard=False):
            batches.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
            taken += len(batch["input_ids"])
            if taken >= eval_pairs:
                break
        self.batches = batches
        self.evaluations = 0

    def plan(self, kept) -> dict[str, list[int]]:
        plan = {path: [] for path in self.attention}
        for path, head in kept:
            plan[path].append(head)
        return {path: sorted(heads) for path, heads in plan.items()}

    def _mask(self, kept) -> None:
        self.gates.fix_(self.plan(kept)).set_mode("binary")
        self.evaluations += 1

    @torch.no_grad()
    def loss(self, kept) -> float:
        """Token-mean cross-entropy (no label smoothing) with only ``kept`` heads."""
        self._mask(kept)
        total = tokens = 0
        for batch in self.batches:
            total += token_cross_entropy(self.model, batch, reduction="sum").item()
            tokens += int((batch["labels"] != -100).sum())
        return total / tokens

    def bleu(self, kept) -> float:
        """Corpus BLEU of greedy/beam decoding (validation settings) with only ``kept`` heads."""
        self._mask(kept)
        hyps, refs = [], []
        for batch in self.batches:
            out = generate(self.model, batch["input_ids"], batch["attention_mask"], self.module.generation)
            hyps += self.module.tokenizer.batch_decode(out, skip_special_tokens=True)
            refs += list(batch["tgt_texts"])
        return corpus_scores(hyps, refs)["bleu"]

    def importance(self, kept, layer_norm_exponent: float | None) -> dict[str, torch.Tensor]:
        self._mask(kept)
        return head_importance(self.model, self.batches, layer_norm_exponent, kinds=self.module.pruning.kinds)


def level_plan(probe: MaskedModel, level: Level) -> dict[str, list[int]]:
    """What a level keeps: its own plan where it names one (every kind), else its kept heads'."""
    return probe.plan(level.kept) if level.plan is None else level.plan


def check_dense(path: Path, saved: dict) -> None:
    """Refuse a checkpoint taken after gating began: its weights learned to work with some heads gated off, and
    the method would score them as the unpruned model."""
    start_step = ((saved.get("hyper_parameters") or {}).get("pruning") or {}).get("start_step")
    if start_step is not None and saved.get("global_step", 0) > start_step:
        raise ValueError(
            f"resume={path} was written at step {saved['global_step']}, after its gated phase began (step "
            f"{start_step}); a method that scores a trained model starts from a dense model: give its dense.ckpt"
        )


def load_weights(module: GatedSeq2Seq, saved: dict | None) -> None:
    """The trained model's weights from the loaded checkpoint ``saved`` (model weights only; gates stay open; None:
    the model as built, e.g. pretrained). The teacher, if fine-tuning distils, is this model too."""
    if saved is not None:
        module.model.load_state_dict(strip_prefix(saved["state_dict"], "model."))
    if module.teacher is not None:
        module.teacher.load_state_dict(module.model.state_dict())


def run(session: Session, method: Method) -> dict:
    """Score the model, find the method's levels, export them; returns the run's metrics (also in metrics.json)."""
    run_start = time.perf_counter()  # the weights were loaded at set-up (load_weights)
    cfg, run_dir, module, datamodule = session.cfg, session.run_dir, session.module, session.datamodule
    tuning, checkpoint, device = session.tuning, session.checkpoint, session.device
    module.to(device)  # the model, its gates (the masks) and the teacher, if fine-tuning distils
    model, gates = module.model.eval(), module.gates
    shutil.rmtree(run_dir / "levels", ignore_errors=True)  # a relaunch with other levels leaves none of the old
    has_test = module.test_generation is not None and "test" in datamodule.datasets
    gates.set_mode("open")
    dense = {"validation": module.score_split(model, "validation", datamodule),
             "test": module.score_split(model, "test", datamodule) if has_test else None}
    print(f"the model pruned from: validation BLEU {dense['validation']['bleu']:.2f}"
          + (f", test BLEU {dense['test']['bleu']:.2f}" if has_test else ""))

    probe = MaskedModel(module, datamodule, method.eval_pairs, device)
    start = time.perf_counter()
    levels = method.levels(probe)
    seconds = time.perf_counter() - start
    print(f"{method.label()}: {len(levels)} levels in {seconds:.1f} s ({probe.evaluations} model evaluations)")

    chosen = levels
    if method.choose_by_bleu():  # the levels as masked, on the whole validation split, to choose from
        for level in levels:
            gates.fix_(level_plan(probe, level)).set_mode("binary")
            level.info["validation"] = headline(module.score_split(model, "validation", datamodule))
        chosen = method.choose([(level, level.info["validation"]["bleu"]) for level in levels],
                               dense["validation"]["bleu"])
        if not chosen:
            raise ValueError(f"{method.label()}: no level to export (pruning.max_bleu_loss keeps none)")

    val_pairs = datamodule.pairs["validation"][: session.export.samples]
    common = dict(method=method.label(), settings=method.describe(), dense=dense, seconds=seconds,
                  evaluations=probe.evaluations, seed=cfg.seed, checkpoint=checkpoint_record(checkpoint, run_dir),
                  params_before=sum(p.numel() for p in model.parameters()))
    exported = {}
    for level in chosen:
        level_dir = run_dir / "levels" / level.name
        gates.fix_(level_plan(probe, level)).set_mode("binary")
        started = time.perf_counter()
        shipped = ship(session, val_pairs, rule="binary", top_k=None, out_dir=level_dir / "pruned",
                       finetune_dir=level_dir / "pruned_finetuned", score_test=has_test)
        # the exported model computes what the masked one does (verified), so its score is the level's
        level.info["validation"] = headline((shipped["finetuned"] or {}).get("validation_before") or shipped["exported"])
        metrics = level_metrics(level, shipped, time.perf_counter() - started, **common)
        metrics["seconds"]["run"] = time.perf_counter() - run_start  # the run up to this level's export
        write_json(level_dir / "metrics.json", metrics)
        exported[level.name] = metrics
    gates.set_mode("open")

    def test_bleu(name: str, which: str) -> float | None:
        return ((exported[name]["test"] if name in exported else {}).get(which) or {}).get("bleu")

    def tuning_failed(name: str) -> str | None:  # the level's fine-tune diverged: its export is what it ships
        return ((exported.get(name) or {}).get("finetune") or {}).get("error")

    def tuned(name: str) -> bool:
        return bool(tuning.steps) and not tuning_failed(name)

    # test BLEU of the export as verified, and of the fine-tuned model where there is one
    summary = [{"heads": level.heads, "name": level.name, **level.info, "exported": level.name in exported,
                "test_bleu": test_bleu(level.name, "pruned_before_finetune" if tuned(level.name) else "pruned"),
                "test_bleu_finetuned": test_bleu(level.name, "pruned") if tuned(level.name) else None,
                **({"finetune_error": tuning_failed(level.name)} if tuning_failed(level.name) else {})}
               for level in levels]
    metrics = {**exported[chosen[-1].name], "levels": summary}
    write_json(run_dir / "metrics.json", metrics)
    print(levels_table(metrics))
    failed = [level for level in chosen if tuning_failed(level.name)]
    if failed:  # every level was shipped (the failed ones as exported and verified); the run still failed
        raise RunFailed(
            f"fine-tuning failed at {len(failed)} of {len(exported)} levels ({', '.join(map(str, failed))}): "
            f"{tuning_failed(failed[0].name)}; each ships its export as verified (its metrics.json says so)"
            + ("; the other levels were fine-tuned" if len(failed) < len(exported) else "")
        )
    return metrics


def level_metrics(level: Level, shipped: dict, ship_seconds: float, *, method: str, settings: dict, dense: dict,
                  seconds: float, evaluations: int, seed: int, checkpoint: str | None,
                  params_before: int) -> dict:
    """metrics.json of one exported level: the keys a gated run's metrics.json has for the model it ships."""
    export, exported, finetuned = shipped["export"], shipped["exported"], shipped["finetuned"]
    totals = heads_in_model(export)
    name = f"exported, fine-tuned {finetuned['steps']} steps ({finetuned['dir']})" if finetuned else "exported"
    if tuning_error(shipped):
        name = UNTUNED
    test = {**({"dense": dense["test"]} if dense["test"] else {}), **shipped["test"]}
    return {
        "method": method, "model": name,
        "bleu": exported["bleu"], "chrf": exported["chrf"], "val_loss": exported["loss"],
        "heads_alive": heads_kept(export), "params": export["params_after"], "plan": export_plan(export),
        **dict(zip(("kept", "kept_total"), exported_structures(export))),
        "heads_total": totals["total"], "heads_per_kind": totals,
        "params_before": params_before,
        "l0_lambda": None, "target_heads": level.heads if level.plan is None else None,
        **{f"target_{unit}": level.budget if level.unit == unit else None for unit in COST_UNITS},
        "settings": settings, "level": level.info,
        "seconds": {"method": seconds, "export_and_score": ship_seconds}, "evaluations": evaluations,
        "checkpoint": checkpoint,
        "dense": {"bleu": dense["validation"]["bleu"], "chrf": dense["validation"]["chrf"],
                  "loss": dense["validation"]["loss"]},
        "test": test or {"note": "no test split: the data source was given none"},
        "export": {"dir": export["dir"], "rule": export["rule"], "heads_kept": export["heads_kept"],
                   **{key: export[key] for key in ("units_kept", "layers_kept") if export.get(key)},
                   "params": export["params_after"], "predicted": export.get("predicted"),
                   "verification": export["verification"]},
        **({"finetune": finetuned} if finetuned else {}),
        "seed": seed, "versions": versions(),
    }


def levels_table(metrics: dict) -> str:
    """Every level: heads kept, validation BLEU and loss and test BLEU of the export as verified, and the test BLEU
    of the fine-tuned model where the levels were fine-tuned; levels drawn at cost budgets lead with the budget and
    the fraction of the dense model's cost kept (parameters: counted; FLOPs, latency: predicted)."""
    tuned = any(level.get("test_bleu_finetuned") is not None for level in metrics["levels"])
    unit = next((u for u in COST_UNITS if any(level.get(f"target_{u}") is not None for level in metrics["levels"])),
                None)

    def bleu(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    budget = (lambda level: (f"{level[f'target_{unit}']:g}", f"{level[f'{unit}_kept']:.4f}")) if unit else (
        lambda level: ())
    rows = [(*budget(level), level["heads"],
             *((f"{level['validation']['bleu']:.2f}", f"{level['validation']['loss']:.3f}")
               if "validation" in level else ("-", "-")),
             bleu(level["test_bleu"]), *([bleu(level["test_bleu_finetuned"])] if tuned else []))
            for level in metrics["levels"]]
    dense = metrics["dense"]
    dense_test = metrics["test"]["dense"]["bleu"] if "dense" in metrics["test"] else None
    rows.insert(0, (*(("-", "1") if unit else ()), metrics["heads_total"], f"{dense['bleu']:.2f}",
                    f"{dense['loss']:.3f}", bleu(dense_test), *(["-"] if tuned else [])))
    what = f"{unit} budget, {unit} and heads kept" if unit else "heads kept"
    return (f"{metrics['method']}: {what} per level (first row: the model pruned from)\n"
            + format_table([*([f"{unit} budget", f"{unit} kept"] if unit else []), "heads", "validation BLEU",
                            "validation loss", "test BLEU (exported)", *(["test BLEU (fine-tuned)"] if tuned else [])],
                           rows))
