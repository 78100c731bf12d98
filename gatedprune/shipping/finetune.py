"""Fine-tuning after pruning: the physically pruned model trains on for a few steps, without gates.

The gated model learned with gate noise; the model that is shipped never did. A short fine-tuning of the exported
model (Xia et al. 2022 fine-tune their pruned model the same way) lets the remaining heads take over from the ones
that went. It applies to whatever produced the plan, so every method can be compared with the same budget.
Optionally the dense model stays the teacher (``finetune.distill``, with the gated phase's ``pruning.distill``; its
``layer_map=nearest`` maps the teacher's layers to the fewer the export kept, through maps of this fine-tune's own,
started at the identity and never saved with the model), and the targets can be the dense model's greedy
translations instead of the references (``finetune.targets=dense_greedy``: ``gatedprune.training.seq_distill``).

It has the gated phase's guards: a step with a non-finite loss or gradient is skipped and counted, ``optim.max_bad_steps``
of them in a row stop it (``FloatingPointError``), and weights that are not finite are never saved. On SIGTERM it saves
``<run>/checkpoints/finetune.ckpt`` (``FineTuneCheckpoint``), and the same command relaunched resumes there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from tqdm.auto import tqdm

from gatedprune.training.guards import BadSteps, zero_non_finite_gradients
from gatedprune.training.distill import DistillOptions, distilled_loss
from gatedprune.training.layer_map import LayerMaps
from gatedprune.training.seq_distill import TARGETS, sequence_targets
from gatedprune.reports.scoring import token_cross_entropy
from gatedprune.utils import check_numbers


@dataclass
class FineTuneConfig:
    """``finetune.*`` (``conf/finetune/default.yaml`` holds the defaults); steps 0 ships the exported model as it is."""

    steps: int = 1000
    lr: float = 2e-3  # the peak: reached after warmup_steps, then decay
    warmup_steps: int = 100  # linear from lr / warmup_steps at the first step to lr
    decay: str = "inverse_sqrt"  # after the warm-up: constant, linear (to 0 at the last step), cosine (likewise), inverse_sqrt
    checkpoint_every: int = 100  # steps between checkpoints (at most 250): a relaunch after a kill resumes there
    val_check_interval: int | None = 250  # steps between validations; the best is shipped (None: the last step's)
    patience: int | None = None  # stop after this many validations in a row without a gain (None: never)
    save_at: list[int] = field(default_factory=list)  # steps whose weights are also saved (<out_dir>_step<N>)
    init: str = "export"  # export: the pruned weights; scratch: the same shapes re-initialised (the fair reference)
    distill: bool = False  # keep distilling from the dense model (needs pruning.distill.alpha or .hidden > 0)
    distill_alpha: float | None = None  # this phase's own output-distillation weight (None: finetune.distill's)
    targets: str = "labels"  # labels, or the dense model's translations: dense_greedy, dense_beam, both_greedy, ...
    targets_max: int | None = None  # translate only the first N training sources (None: all)
    out_dir: str = "pruned_finetuned"
    cache_dir: str = "cache"  # where dense_greedy's translations are cached (seqkd-<key>.jsonl)

    def __post_init__(self) -> None:
        check_numbers("finetune", self)
        if self.steps < 0 or not self.lr > 0:
            raise ValueError(f"finetune.steps={self.steps}, finetune.lr={self.lr}; allowed: steps >= 0, lr > 0")
        if self.decay not in DECAYS:
            raise ValueError(f"finetune.decay={self.decay!r}; allowed: {', '.join(DECAYS)}")
        if not 1 <= self.checkpoint_every <= MAX_CHECKPOINT_EVERY:
            raise ValueError(f"finetune.checkpoint_every={self.checkpoint_every}; allowed: 1 to {MAX_CHECKPOINT_EVERY} "
                             "steps (what a kill can lose)")
        if self.warmup_steps < 0 or (self.steps and self.warmup_steps > self.steps):
            raise ValueError(f"finetune.warmup_steps={self.warmup_steps} with finetune.steps={self.steps}; allowed: "
                             f"0 <= warmup_steps <= steps (a warm-up no longer than the phase: e.g. "
                             f"finetune.warmup_steps={max(self.steps // 10, 0)}, or finetune=short, a constant rate)")
        if self.val_check_interval is not None and not (isinstance(self.val_check_interval, int)
                                                        and self.val_check_interval >= 1):
            raise ValueError(f"finetune.val_check_interval={self.val_check_interval}; allowed: a number of steps >= 1, "
                             "or null (no validation during fine-tuning)")
        if self.patience is not None and (self.val_check_interval is None or not isinstance(self.patience, int)
                                          or not self.patience >= 1):
            raise ValueError(f"finetune.patience={self.patience} with finetune.val_check_interval="
                             f"{_shown(self.val_check_interval)}; allowed: patience >= 1 with a validation interval "
                             "(patience counts validations), or null")
        steps_ok = all(isinstance(step, int) and not isinstance(step, bool) for step in self.save_at)
        if not steps_ok or any(not 1 <= step <= self.steps for step in self.save_at):
            raise ValueError(f"finetune.save_at={self.save_at} with finetune.steps={self.steps}; allowed: steps from 1 "
                             "to finetune.steps")
        if self.init not in INITS:
            raise ValueError(f"finetune.init={self.init!r}; allowed: {', '.join(INITS)}")
        self.save_at = sorted(set(self.save_at))
        if self.targets not in TARGETS:
            raise ValueError(f"finetune.targets={self.targets!r}; allowed: {', '.join(TARGETS)}")
        if self.targets_max is not None and not (isinstance(self.targets_max, int) and self.targets_max >= 1
                                                 and self.targets != "labels"):
            raise ValueError(f"finetune.targets_max={self.targets_max} with finetune.targets={self.targets}; allowed: "
                             "a number of sentences >= 1 with the dense model's translations as targets, or null")
        if self.distill_alpha is not None and not 0 < self.distill_alpha <= 1:
            raise ValueError(f"finetune.distill_alpha={self.distill_alpha}; allowed: 0 < alpha <= 1 (the weight of the "
                             "output distillation term in this phase), or null")

    @property
    def distils(self) -> bool:
        """Whether this phase distils from the dense model (``distill``, or a weight of its own)."""
        return self.distill or self.distill_alpha is not None


DECAYS = ("constant", "linear", "cosine", "inverse_sqrt")
INITS = ("export", "scratch")  # scratch: gatedprune.shipping.reinit, the pruned shapes trained from nothing
MAX_CHECKPOINT_EVERY = 250  # a long fine-tune must survive the end of a session: at most this many steps are lost


def _shown(value) -> str:
    return "null" if value is None else str(value)


def lr_factor(step: int, steps: int, warmup_steps: int, decay: str) -> float:
    """The learning rate of (0-based) step ``step`` of ``steps``, as a fraction of the peak ``finetune.lr``.

    Warm-up: (step + 1) / warmup_steps, so the first step already trains. Then, with t = step - warmup_steps and
    n = steps - warmup_steps: constant 1; linear 1 - t / n; cosine (1 + cos(pi t / n)) / 2; inverse_sqrt
    sqrt(max(warmup_steps, 1) / (step + 1)), as the dense phase's schedule.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t, n = step - warmup_steps, max(steps - warmup_steps, 1)
    if decay == "linear":
        return max(0.0, 1.0 - t / n)
    if decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(t, n) / n))
    if decay == "inverse_sqrt":
        return math.sqrt(max(warmup_steps, 1) / (step + 1))
    return 1.0


class PrunedFineTuning(L.LightningModule):
    """Cross-entropy (label smoothing as in training), optionally with the distillation term, on a plain model.

    ``identity`` (plain data: the export's directory and plan, steps, lr, ...) goes into its checkpoints, so a
    relaunch resumes only the very fine-tune that was interrupted.
    """

    def __init__(self, model: nn.Module, config: FineTuneConfig, label_smoothing: float,
                 teacher: nn.Module | None = None, distill: DistillOptions | None = None, *,
                 max_bad_steps: int = 10, seed: int = 0, identity: dict | None = None):
        super().__init__()
        self.model, self.config, self.label_smoothing = model, config, label_smoothing
        self.teacher, self.distill = teacher, distill
        # the teacher's layers to the student's (pruning.distill.layer_map=nearest): trained here, not exported
        self.layer_maps = LayerMaps.for_model(teacher) if teacher is not None and distill.maps_layers else None
        self.seed, self.identity = seed, identity or {}
        self.bad_steps = BadSteps(max_bad_steps, "fine-tuning step")
        self.first_step = 0

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        if self.teacher is not None:
            ce, loss, _ = distilled_loss(self.model, self.teacher, batch, self.distill, self.label_smoothing,
                                         self.layer_maps)
        else:
            loss = ce = token_cross_entropy(self.model, batch, self.label_smoothing)
        self.log("finetune/ce", ce, prog_bar=True, batch_size=int((batch["labels"] != -100).sum()))
        if not torch.isfinite(loss):
            self._skip_step(f"loss is {loss.item()}")
            return None  # Lightning then skips backward and the optimiser step (one device: no process waits)
        return loss

    def on_train_start(self) -> None:
        self.first_step = self.global_step  # a resumed fine-tune times only the steps it trains
        resumed = f", resumed at step {self.global_step}" if self.global_step else ""
        c = self.config
        schedule = "" if (c.warmup_steps, c.decay) == (0, "constant") else f" ({c.warmup_steps} warm-up, {c.decay})"
        print(f"fine-tuning {self.identity.get('dir', 'the export')}: {c.steps} steps at lr {c.lr}{schedule}"
              f"{resumed}")

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        # dropout of fine-tuning step k depends on (seed, k) alone, so a resumed fine-tune draws what an
        # uninterrupted one would have (the offset keeps it apart from the gated phase's steps)
        torch.manual_seed(self.seed * 1_000_003 + 2**41 + self.global_step)

    def on_before_optimizer_step(self, optimizer) -> None:
        finite = zero_non_finite_gradients(self.parameters(), optimizer)  # None: a non-finite loss, counted
        if finite is False:
            self._skip_step("a gradient is not finite")
        elif finite:
            self.bad_steps.good()

    def _skip_step(self, why: str) -> None:
        self.bad_steps.skip(
            self.global_step, why, prefix="fine-tuning: ", stopped=(
                f"stopped at fine-tuning step {self.global_step} of {self.config.steps} "
                f"(finetune.lr={self.config.lr}: lower it?)"))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        check_finite(self.model, f"fine-tuning step {self.global_step}")
        checkpoint["finetune"] = self.identity
        checkpoint["skipped_steps"] = self.bad_steps.total
        checkpoint["bad_in_a_row"] = self.bad_steps.in_a_row

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.bad_steps.total = checkpoint.get("skipped_steps", 0)
        self.bad_steps.in_a_row = checkpoint.get("bad_in_a_row", 0)

    def configure_optimizers(self):
        maps = list(self.layer_maps.parameters()) if self.layer_maps is not None else []
        optimizer = torch.optim.AdamW(list(self.model.parameters()) + maps, lr=self.config.lr, weight_decay=0.0)
        config = self.config
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, config.steps, config.warmup_steps, config.decay))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def check_finite(model: nn.Module, when: str) -> None:
    """``FloatingPointError`` if any weight of ``model`` is not finite: such weights are never saved."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(
            f"fine-tuning: {len(bad)} weight tensor(s) are not finite at {when} (e.g. {bad[0]}); they were not saved "
            "(lower finetune.lr?)"
        )


class FineTuneCheckpoint(L.Callback):
    """Save the fine-tune's whole state to ``path`` (weights, optimiser, schedule, step, data position: tensors and
    plain data) every ``every`` steps and on SIGTERM, unless its weights are not finite; ``message`` then says what
    SIGTERM saved, for the run's status. The file is written beside its target and renamed (the trainer's
    ``AtomicCheckpointIO``), so a kill (SIGKILL too) leaves the last whole one, which a relaunch resumes."""

    def __init__(self, path: str | Path, every: int | None = None):
        self.path, self.every, self.message = Path(path), every, None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every and step % self.every == 0 and 0 < step < pl_module.config.steps:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.path, weights_only=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        where = f"fine-tuning step {trainer.global_step} of {pl_module.config.steps}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.path, weights_only=False)
        except FloatingPointError:  # on_save_checkpoint refused weights that are not finite
            self.message = (f"SIGTERM during fine-tuning at {where}: its weights were not finite, nothing was saved; "
                            "the same command fine-tunes from the export again")
        else:
            self.message = (f"SIGTERM during fine-tuning: saved {self.path} at {where}; the same command resumes "
                            "fine-tuning there")
        print(self.message)


class StepProgress(L.Callback):
    """One progress bar over the fine-tune's optimiser steps (a resumed one from where it resumed), with the last
    cross-entropy: Lightning's bar counts each epoch's batches, and a phase of thousands of steps spans many epochs."""

    def __init__(self, refresh: int = 10):
        self.refresh, self.bar = refresh, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="fine-tuning", unit="step",
                        dynamic_ncols=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.bar is not None and (step % self.refresh == 0 or step == trainer.max_steps):
            ce = trainer.callback_metrics.get("finetune/ce")
            if ce is not None:
                self.bar.set_postfix(ce=f"{float(ce):.3f}", refresh=False)
            self.bar.update(step - self.bar.n)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def resume_point(path: Path, identity: dict) -> Path | None:
    """``path`` if it is a fine-tuning checkpoint of this very fine-tune (``identity``), else None (said why)."""
    if not path.is_file():
        return None
    try:  # tensors and plain data only: a file that would run code is not unpickled
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        print(f"note: {path} is not a readable fine-tuning checkpoint ({type(err).__name__}): fine-tuning starts "
              "from the export")
        return None
    if not isinstance(saved, dict) or saved.get("finetune") != identity:
        print(f"note: {path} was written by another fine-tune (another export, plan or finetune.* settings): "
              f"fine-tuning {identity.get('dir')} starts from the export")
        return None
    return path


def finetune(model: nn.Module, datamodule, config: FineTuneConfig, trainer: L.Trainer, label_smoothing: float,
             teacher: nn.Module | None = None, distill: DistillOptions | None = None, *, max_bad_steps: int = 10,
             seed: int = 0, identity: dict | None = None, resume: Path | None = None,
             dense: nn.Module | None = None, timing: dict | None = None) -> nn.Module:
    """Train ``model`` (pruned, ungated) for ``config.steps`` steps on the training split (from the checkpoint
    ``resume``, if given); returns it in eval mode.

    ``finetune.targets=dense_greedy`` trains on ``dense``'s greedy translations of the training sources (default:
    the teacher, which is the dense model), made on ``model``'s device or read from ``config.cache_dir``; the
    references are back in ``datamodule`` afterwards.

    ``FloatingPointError`` if it diverged: ``max_bad_steps`` bad steps in a row, or the last step bad (the weights
    then give no finite loss); the caller checks the weights (``check_finite``) before it saves them.
    ``SIGTERMException`` carries what was saved on SIGTERM. ``timing``, if given, receives ``wall_s`` (targets, the
    teacher's passes and training, in this process) and ``steps`` (trained in this process: a resumed fine-tune's rest).
    """
    started = time.perf_counter()
    datamodule.load_state_dict({})  # from the first batch of an epoch, whatever the gated run had reached
    module = PrunedFineTuning(model.train(), config, label_smoothing, teacher, distill, max_bad_steps=max_bad_steps,
                              seed=seed, identity=identity)
    kind = TARGETS[config.targets]
    if kind is not None:
        dense = dense if dense is not None else teacher
        if dense is None:
            raise ValueError(f"finetune.targets={config.targets} needs the dense model; none was given to the fine-tune")
        device = next(model.parameters()).device
        texts = sequence_targets(dense, datamodule, config.cache_dir, device, kind.num_beams, config.targets_max)
        datamodule.set_train_targets(texts, keep_references=kind.references)
    try:
        # weights_only: Lightning unpickles only tensors and plain data, so a checkpoint cannot run code on resume
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
        if timing is not None:
            timing.update(wall_s=time.perf_counter() - started, steps=trainer.global_step - module.first_step)
    except SIGTERMException:
        saved = [c.message for c in trainer.callbacks if isinstance(c, FineTuneCheckpoint) and c.message]
        raise SIGTERMException(saved[0] if saved else "SIGTERM during fine-tuning; nothing was saved") from None
    finally:
        datamodule.set_train_targets(None)  # validation never read them; what runs next trains on the references
    if module.bad_steps.in_a_row:
        raise FloatingPointError(
            f"fine-tuning: its last {module.bad_steps.in_a_row} step(s) had a non-finite loss or gradient, so the weights it "
            f"ended with give none (finetune.lr={config.lr}: lower it?)"
        )
    return model.eval()
