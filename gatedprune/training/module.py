"""The Lightning module: gated fine-tuning of a Hugging Face seq2seq model (Voita et al. 2019).

loss = per-token mean cross-entropy + the pruning method's penalty (``gatedprune.methods``: lambda x the expected
number of open heads, or a Lagrangian towards a head budget). Before ``start_step`` the gates are held open and the
penalty is off (the dense phase), so one run can train a baseline and then prune it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.kinds import ATTENTION_KINDS
from gatedprune.training.checkpoints import add_new_gates, describe, drop_unused_gates
from gatedprune.training.distill import distilled_loss, frozen_copy
from gatedprune.training.layer_map import LayerMaps, fit_checkpoint
from gatedprune.training.guards import BadSteps, zero_non_finite_gradients
from gatedprune.reports.scoring import GenerationConfig, corpus_scores, generate, score, token_cross_entropy
from gatedprune.reports.plots import save_gate_heatmap
from gatedprune.utils import check_numbers


def _distributed() -> bool:
    """True inside a DDP process group of more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class OptimConfig:
    """AdamW for the model weights, linear warm-up then inverse square-root decay."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 400
    label_smoothing: float = 0.1
    max_bad_steps: int = 10  # consecutive steps with a non-finite loss or gradient before the run stops

    def __post_init__(self) -> None:
        check_numbers("optim", self)
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}; allowed: a number > 0")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"optim.label_smoothing={self.label_smoothing}; allowed: 0 <= value < 1")
        if self.max_bad_steps < 1:
            raise ValueError(f"optim.max_bad_steps={self.max_bad_steps}; allowed: an integer >= 1")


class GatedSeq2Seq(L.LightningModule):
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pruning,  # gatedprune.methods.gated.GatedPruning: what is gated, the penalty, the export rule
        optim: OptimConfig,
        generation: GenerationConfig,
        output_dir: str | Path = ".",
        seed: int = 0,
        test_generation: GenerationConfig | None = None,
    ):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.pruning = pruning
        self.optim = optim
        self.generation = generation
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.gates = attach_gates(model, pruning.kinds, ffn_group=pruning.ffn_group, **asdict(pruning.gates))
        self.budget = pruning.build(self.gates, model)  # a method's own trainable state (a head budget's multipliers)
        # the dense model as teacher (pruning.distill): a frozen copy, refreshed when the gated phase starts; kept
        # too, though nothing distils, when the fine-tune trains on its translations (finetune.targets)
        self.teacher = frozen_copy(model) if pruning.distill.on or getattr(pruning, "keeps_dense", False) else None
        # the teacher's layers to the student's (pruning.distill.layer_map=nearest): trained, never exported
        self.layer_maps = LayerMaps.for_model(self.teacher) if pruning.distill.maps_layers else None
        self._teacher_ready = False
        self.teacher_ms: list[float] = []  # what the teacher's forward costs, per step
        self.save_hyperparameters(
            {"pruning": asdict(pruning), "optim": asdict(optim), "generation": asdict(generation)}
        )
        self.test_generation = test_generation  # decoding of the test split; None: the test split is not scored
        self.dense_metrics: dict = {}  # the last validation of the dense phase, for the final comparison
        self.dense_test: dict | None = None  # the dense model's test-split score (see score_test)
        self.signature: dict = {}  # sacreBLEU signatures of the last validation
        self.bad_steps = BadSteps(optim.max_bad_steps)  # steps skipped for a non-finite loss or gradient
        # per gated validation: heads the plan export keeps gained or lost since the previous validation (the first
        # one: since the dense model, every head kept), and the gates not yet settled
        self.plan_changes: list[dict] = []
        self._last_plan: dict | None = None
        self._val_hyps: list[str] = []
        self._val_refs: list[str] = []

    # ---- phases -------------------------------------------------------------------------------------
    @property
    def gating(self) -> bool:
        """True once the dense phase is over: ``start_step`` optimiser steps have been taken."""
        return self.global_step >= self.pruning.start_step

    @property
    def gates_trained(self) -> bool:
        """True once at least one gated step was taken; validation at ``start_step`` still sees the dense model."""
        return self.global_step > self.pruning.start_step

    def _train_gate_mode(self) -> str:
        return "sample" if self.gating else "open"

    def _eval_gate_mode(self) -> str:
        return self.pruning.eval_gate_mode if self.gates_trained else "open"

    # ---- training -----------------------------------------------------------------------------------
    def _cross_entropy(self, batch: dict, label_smoothing: float) -> torch.Tensor:
        return token_cross_entropy(self.model, batch, label_smoothing)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.gates.set_mode(self._train_gate_mode())
        if self.gating:
            self.gates.set_temperature(self.pruning.temperature(self.global_step - self.pruning.start_step))
            self.pruning.before_step(self.gates, self.budget, self.global_step - self.pruning.start_step)
        if self.pruning.distill.on and self.gating:
            ce, loss = self._distilled(batch)
        else:
            ce = loss = self._cross_entropy(batch, self.optim.label_smoothing)
        if self.gating:
            penalty, logs = self.pruning.penalty(self.gates, self.budget, self.global_step - self.pruning.start_step)
            loss = loss + penalty
            self.log_dict({**logs, "train/gate_temperature": self.gates.options.temperature}, batch_size=1)
        ntokens = int((batch["labels"] != -100).sum())
        self.log("train/ce", ce, prog_bar=True, batch_size=ntokens)
        self.log("train/loss", loss, batch_size=ntokens)
        self.log("train/expected_open", self.gates.expected_open(), prog_bar=True, batch_size=1)
        if not torch.isfinite(loss) and not _distributed():
            self._skip_step(f"loss is {loss.item()}")
            return None  # Lightning then skips backward and the optimiser step
        # under DDP every process must run backward, or the others wait for it forever: the gradients, averaged
        # across processes, are then non-finite in all of them, and on_before_optimizer_step skips the step
        return loss

    def _distilled(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(CE on the labels, the distilled task loss: gatedprune.training.distill)."""
        ce, loss, logs = distilled_loss(self.model, self.teacher, batch, self.pruning.distill,
                                        self.optim.label_smoothing, self.layer_maps)
        self.teacher_ms.append(logs["teacher_ms"])
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, batch_size=1)
        return ce, loss

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        if self.teacher is not None and self.gating and not self._teacher_ready:
            # the first gated step: the weights now are the dense model's (the end of the dense phase, the checkpoint
            # a fork started from, or the model a run without a dense phase starts with)
            self.teacher.load_state_dict(self.model.state_dict())
            self._teacher_ready = True
        # gate noise and dropout of step k depend on (seed, k, DDP rank) alone, so a resumed run draws what an
        # uninterrupted one would have, whatever else consumed random numbers in between; DDP processes draw
        # different gate samples, and their averaged gradients keep log_alpha identical across them
        torch.manual_seed(self.seed * 1_000_003 + self.global_step + self.global_rank * 2**40)

    def on_train_start(self) -> None:
        self.first_step = self.global_step  # what this process trains: a resumed run times its own part
        if self.pruning.start_step == 0 and self.global_step == 0 and self.trainer.is_global_zero:
            self.dense_test = self.score_test("the model the run starts from")
        own = self.output_dir / "checkpoints" / "last.ckpt"  # a fork from another run's checkpoint trains on
        if self.trainer.ckpt_path and Path(self.trainer.ckpt_path).resolve() == own.resolve() and self._plan_is_stable():
            print(f"resumed at step {self.global_step}: the plan was already stable, the gated phase stays over")
            self.trainer.should_stop = True
        if self.trainer.ckpt_path:
            log_alpha = self.gates.log_alpha()
            print(
                f"resumed at step {self.global_step}: gates restored (sum of log_alpha {log_alpha.sum().item():.6f}, "
                f"{self.gates.heads_alive()['total']} of {self.gates.num_heads} heads open, {log_alpha.numel()} gates)"
            )

    def on_before_optimizer_step(self, optimizer) -> None:
        finite = zero_non_finite_gradients(self.parameters(), optimizer)  # None: a non-finite loss, counted already
        if finite is False:
            self._skip_step("a gradient is not finite")
        elif finite:
            self.bad_steps.good()

    def _skip_step(self, why: str) -> None:
        self.bad_steps.skip(self.global_step, why,
                            f"stopped at step {self.global_step}, the last checkpoint is the last good one")

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient, in all (``metrics.json``)."""
        return self.bad_steps.total

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.gates.clamp_()
        if hasattr(self.budget, "project_"):  # a cost budget's multipliers kept where its rules allow
            self.budget.project_()

    def configure_optimizers(self):
        maps = list(self.layer_maps.parameters()) if self.layer_maps is not None else []  # last of the model's group
        groups = [
            {"params": list(self.model.parameters()) + maps, "weight_decay": self.optim.weight_decay,
             "lr": self.optim.lr},
            {"params": list(self.gates.parameters()), "weight_decay": 0.0, "lr": self.pruning.gate_lr},
        ]
        groups += self.pruning.param_groups(self.budget)  # the method's own state (a head budget's multipliers)
        optimizer = torch.optim.AdamW(groups, betas=tuple(self.optim.betas))
        warmup = max(1, self.optim.warmup_steps)

        def model_schedule(step: int) -> float:  # linear warm-up, then inverse square root
            step = step + 1
            return min(step / warmup, math.sqrt(warmup / step))

        constant = [lambda step: 1.0] * (len(groups) - 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [model_schedule, *constant])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- validation ---------------------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.gates.set_mode(self._eval_gate_mode())
        ntokens = int((batch["labels"] != -100).sum())
        self.log("val/loss", self._cross_entropy(batch, 0.0), batch_size=ntokens, prog_bar=True, sync_dist=True)
        self._val_hyps += self.translate(batch["input_ids"], batch["attention_mask"])
        self._val_refs += list(batch["tgt_texts"])

    def translate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
        out = generate(self.model, input_ids, attention_mask, self.generation)
        return self.tokenizer.batch_decode(out, skip_special_tokens=True)

    def on_validation_epoch_end(self) -> None:
        hyps, refs = self._val_hyps, self._val_refs
        self._val_hyps, self._val_refs = [], []
        if _distributed():  # DDP: every process scores the whole validation set
            shares = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shares, (hyps, refs))
            hyps, refs = [h for share, _ in shares for h in share], [r for _, share in shares for r in share]
        if not hyps:
            return
        corpus = corpus_scores(hyps, refs)
        scores = {"val/bleu": corpus["bleu"], "val/chrf": corpus["chrf"]}
        alive = self.gates.heads_alive() if self.gates_trained else self.heads_total()
        # heads as before; FFN units and layers under their own name (val/kept_encoder_ffn: units, not heads)
        scores.update({(f"val/heads_alive_{k}" if k == "total" or k in ATTENTION_KINDS else f"val/kept_{k}"): float(v)
                       for k, v in alive.items()})
        expected = self.gates.expected_open_per_kind()
        scores.update({"val/expected_open" + ("" if k == "total" else f"_{k}"): v for k, v in expected.items()})
        if self.gates_trained and self.budget is not None:  # a budget's target beside where the gates are now
            scores.update({f"val/budget_{group}_{key}": value for group, state in self.budget.report().items()
                           for key, value in state.items() if not isinstance(value, str) and key != "target"})
        self.log_dict(scores, prog_bar=False, batch_size=1)
        self.signature = corpus["sacrebleu_signature"]
        if not self.trainer.sanity_checking and not self.gates_trained:
            self.dense_metrics = {"step": self.global_step, "bleu": scores["val/bleu"], "chrf": scores["val/chrf"]}
        fitting = self.trainer.state.fn == "fit" and not self.trainer.sanity_checking
        if fitting:
            self._track_plan()
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        if self.global_step == self.pruning.start_step > 0 and fitting:
            self.dense_test = self.score_test("the end of the dense phase")  # the model every fork starts from
        for hyp, ref in list(zip(hyps, refs))[: self.generation.log_examples]:
            print(f"  ref: {ref}\n  hyp: {hyp}")
        png = save_gate_heatmap(
            self.gates, self.output_dir / "gates" / f"step_{self.global_step:07d}.png", step=self.global_step
        )
        for logger in self.loggers:
            if hasattr(logger, "log_image"):  # Weights & Biases
                logger.log_image("gates/heatmap", [str(png)], step=self.global_step)

    def _track_plan(self) -> None:
        """Record how far the gates have settled; stop training once the plan is stable (``stop_when_stable``).

        The plan is the one export would keep: log_alpha > 0, or the top-k set under a head budget (whose binary
        plan keeps moving as the multipliers push the expected count around the target). Every process computes
        the same (the gates are identical under DDP), so all of them stop together.
        """
        plan = self.gates.plan(*self.pruning.export_rule(self.budget))
        if not self.gates_trained:  # the dense phase: the model keeps every head, whatever the rule would say
            self._last_plan = self.gates.plan(keep=torch.ones(self.gates.num_gates, dtype=torch.bool), note=False)
            return
        if self._last_plan is None or set(self._last_plan) != set(plan):
            # a fork from a gated checkpoint of another rule, or of fewer kinds: this validation is the baseline
            self._last_plan = plan
            return
        changed = sum(len(set(plan[path]) ^ set(self._last_plan[path])) for path in plan)
        self._last_plan = plan
        self.plan_changes.append({"step": self.global_step, "changed": changed, "unconverged": self.gates.unconverged()})
        if self._plan_is_stable():
            print(f"the plan has not changed for {self.pruning.stop_when_stable} validations: the gated phase ends at "
                  f"step {self.global_step}")
            self.trainer.should_stop = True

    def _plan_is_stable(self) -> bool:
        """No head changed side for ``stop_when_stable`` validations in a row, all of them after the method's
        ``settles_from`` gated steps (False when ``stop_when_stable`` is not set)."""
        patience = self.pruning.stop_when_stable
        recent = self.plan_changes[-patience:] if patience else []
        earliest = self.pruning.start_step + self.pruning.settles_from()
        return (bool(patience) and len(recent) == patience
                and all(entry["changed"] == 0 and entry["step"] >= earliest for entry in recent))

    def score_test(self, what: str) -> dict | None:
        """The test-split score of the model as it is now, gates open (the dense model); None without a test split.

        Rank 0 alone decodes (the other DDP processes wait for it at their next collective).
        """
        datamodule = self.trainer.datamodule
        if self.test_generation is None or "test" not in datamodule.datasets:
            return None
        mode, training = self.gates.mode, self.model.training
        self.gates.set_mode("open")
        result = self.score_split(self.model, "test", datamodule)
        self.gates.set_mode(mode)
        self.model.train(training)
        print(f"test split, {what} (step {self.global_step}): BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f}")
        return {"step": self.global_step, **result}

    def score_split(self, model, split: str, datamodule) -> dict:
        """``model`` on a whole split: validation decoded as validation is, the test split with ``test_generation``."""
        gen = self.generation if split == "validation" else self.test_generation
        return score(model, self.tokenizer, datamodule.loader(split, gen.batch_size, shard=False), gen)

    def heads_total(self) -> dict[str, int]:
        """Every gated structure counted as alive (the dense phase): per kind, and the heads in total."""
        return self.gates.heads_per_kind()

    # ---- checkpoints describe themselves, so the exporter needs nothing else --------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # an optimiser step with finite loss and gradients can still overflow the weights (AdamW at a huge learning
        # rate); such weights are never saved, so the last checkpoint on disk stays the last good one
        if not all(torch.isfinite(p).all() for p in self.parameters()):
            raise FloatingPointError(
                f"the weights are not finite at step {self.global_step}; stopped without saving them, the last "
                "checkpoint is the last good one (lower optim.lr?)"
            )
        checkpoint.update(describe(self))
        checkpoint["dense_metrics"] = self.dense_metrics
        checkpoint["dense_test"] = self.dense_test
        checkpoint["plan_changes"] = self.plan_changes
        checkpoint["last_plan"] = self._last_plan
        checkpoint["last_plan_rule"] = self.pruning.rule_key(self.budget)
        checkpoint["teacher_ready"] = self._teacher_ready
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.dense_metrics = checkpoint.get("dense_metrics", {})
        self.dense_test = checkpoint.get("dense_test")
        self.bad_steps.total = checkpoint.get("skipped_steps", 0)
        self.plan_changes = checkpoint.get("plan_changes", [])
        same_rule = checkpoint.get("last_plan_rule") == self.pruning.rule_key(self.budget)
        self._last_plan = checkpoint.get("last_plan") if same_rule or not checkpoint.get("plan_changes") else None
        self._teacher_ready = checkpoint.get("teacher_ready", False)
        state = checkpoint["state_dict"]
        saved_teacher = any(key.startswith("teacher.") for key in state)
        if self.teacher is None and saved_teacher:  # distillation was on in the run that wrote it, and is off now
            for key in [k for k in state if k.startswith("teacher.")]:
                del state[key]
        elif self.teacher is not None and not saved_teacher:  # e.g. a fork from a dense.ckpt written without it
            state.update({f"teacher.{k[len('model.'):]}": v for k, v in list(state.items()) if k.startswith("model.")})
            self._teacher_ready = False
        fit_checkpoint(checkpoint, self.layer_maps)  # a checkpoint written with(out) layer maps: identity ones, or none
        # a fork that gates more kinds than the checkpoint (a heads-only dense.ckpt): the new gates start fresh
        add_new_gates(checkpoint, self.gates)
        drop_unused_gates(checkpoint, self.gates)  # one that gates fewer (the every-kind default's dense.ckpt)
        # a fork from a checkpoint another method wrote: the method fits its own state and optimiser groups
        self.pruning.migrate_checkpoint(checkpoint, self.budget, prefix="budget.")
        self._take_own_learning_rates(checkpoint)

    def _take_own_learning_rates(self, checkpoint: dict) -> None:
        """The gates' and the method's optimiser groups train at this run's rates (``pruning.gate_lr``, a budget's
        ``lagrangian_lr``), not at those the checkpoint saved: a fork that sets them gets them (it silently kept the
        checkpoint's). The model's group keeps the checkpoint's schedule (``gatedprune.training.schedule``)."""
        lrs = [self.pruning.gate_lr] + [group["lr"] for group in self.pruning.param_groups(self.budget)]
        for optimizer in checkpoint.get("optimizer_states", []):
            for group, lr in zip(optimizer["param_groups"][1:], lrs):
                group["lr"] = group["initial_lr"] = lr
        for scheduler in checkpoint.get("lr_schedulers", []):  # LambdaLR: a constant 1 for these groups
            for key in ("base_lrs", "_last_lr"):
                if key in scheduler:
                    scheduler[key] = scheduler[key][:1] + lrs
