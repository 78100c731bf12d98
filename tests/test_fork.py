"""A fork takes its dense phase and learning-rate schedule from its checkpoint, and the comparison presets give every
method the same training after the dense checkpoint (gatedprune.training.schedule)."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from gatedprune.training.schedule import settle
from helpers import ROOT, compose_train, error_line, run_train

CONF = ROOT / "conf"


# ---- the schedule a fork gets (no training: a checkpoint file holding what the fork reads) ---------------------

def _checkpoint(tmp_path: Path, step: int, start_step: int, name: str = "dense.ckpt") -> Path:
    """``<source run>/checkpoints/<name>`` saved at ``step`` by a run whose dense phase was ``start_step`` steps
    (experiment=converge's: 100000, a bound), warm-up 4000 and lr 5e-4 (not the default 400 and 1e-3)."""
    run = tmp_path / "source"
    (run / "tokenizer").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints").mkdir(exist_ok=True)
    path = run / "checkpoints" / name
    torch.save({"global_step": step, "hyper_parameters": {"pruning": {"start_step": start_step},
                                                          "optim": {"lr": 5e-4, "warmup_steps": 4000}}}, path)
    return path


def _fork_run(directory: Path, step: int, began: int) -> Path:
    """A fork's own run directory with a ``last.ckpt`` at ``step``, its gated phase begun at ``began``, saved with
    the schedule it took from the checkpoint it forked (warm-up 4000, lr 5e-4)."""
    (directory / "tokenizer").mkdir(parents=True, exist_ok=True)
    (directory / "checkpoints").mkdir(exist_ok=True)
    path = directory / "checkpoints" / "last.ckpt"
    torch.save({"global_step": step, "hyper_parameters": {"pruning": {"start_step": began},
                                                          "optim": {"lr": 5e-4, "warmup_steps": 4000}}}, path)
    return path


# the model trained from scratch with a dense phase (the experiments' model; the default starts from the teacher)
SCRATCH = "model=scratch_mbart"


def test_a_fork_continued_any_way_keeps_its_boundary_and_schedule(tmp_path):
    """resume=auto in the fork's own directory, or resume=<the fork's run directory> from a new one: the config says
    dense_steps 750 and the default schedule, the checkpoint that gating began at 3250 with warm-up 4000."""
    gated = _default_gated_steps(tmp_path)
    _fork_run(tmp_path / "run", step=3300, began=3250)
    for resume in ("resume=auto", f"resume={tmp_path / 'run'}"):
        cfg, schedule = _settled(tmp_path, resume, "pruning=l0_budget")
        assert (cfg.pruning.start_step, cfg.trainer.max_steps) == (3250, 3250 + gated), resume
        assert (cfg.optim.lr, cfg.optim.warmup_steps) == (5e-4, 4000) and schedule["fork"]["continued"]
    with pytest.raises(ValueError, match=r"dense_steps=750 on a run continued from .* began at step 3250"):
        _settled(tmp_path, "resume=auto", "dense_steps=750")
    # a plain run continued past its boundary, which agrees with its config: as configured
    _fork_run(tmp_path / "plain", step=800, began=750)
    cfg = compose_train(tmp_path / "plain", SCRATCH, f"resume={tmp_path / 'plain'}", hydra_config=True)
    assert settle(cfg, tmp_path / "plain")["fork"] is None and cfg.optim.warmup_steps == 400


def _settled(tmp_path: Path, *overrides: str):
    """The config as a run settles it (the overrides count as typed on the command line), and its schedule."""
    cfg = compose_train(tmp_path / "run", SCRATCH, *overrides, hydra_config=True)
    return cfg, settle(cfg, tmp_path / "run")


def _default_gated_steps(tmp_path: Path, *overrides: str) -> int:
    """The gated phase of the config without a fork: its trainer.max_steps less its dense phase."""
    cfg = compose_train(tmp_path / "plain", SCRATCH, *overrides)
    return cfg.trainer.max_steps - cfg.dense_steps


def test_a_fork_of_a_converged_checkpoint_starts_gating_at_its_step_with_its_schedule(tmp_path):
    path = _checkpoint(tmp_path, step=3250, start_step=100000)
    gated = _default_gated_steps(tmp_path)
    cfg, schedule = _settled(tmp_path, f"resume={path}", "pruning=l0_budget")
    assert (cfg.dense_steps, cfg.pruning.start_step, cfg.trainer.max_steps) == (3250, 3250, 3250 + gated)
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (5e-4, 4000)  # the checkpoint's, not conf/optim's
    assert schedule == {"start_step": 3250, "gated_steps": gated, "max_steps": 3250 + gated, "warmup_steps": 4000,
                        "fork": {"checkpoint": str(path), "step": 3250, "continued": False}}
    cfg, _ = _settled(tmp_path, f"resume={path}", "gated_steps=300")
    assert (cfg.pruning.start_step, cfg.trainer.max_steps) == (3250, 3550)
    # relaunched in its own directory, it continues from its own last.ckpt with the schedule it started with
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 3300}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    cfg, _ = _settled(tmp_path, f"resume={path}", "gated_steps=300")
    assert (cfg.pruning.start_step, cfg.trainer.max_steps) == (3250, 3550)


@pytest.mark.parametrize("typed, named", [
    ("dense_steps=750", "dense_steps=750"),
    ("pruning.start_step=800", "pruning.start_step=800"),
    ("trainer.max_steps=1050", "trainer.max_steps=1050"),  # dense_steps 750: meant 300 gated steps? said, not guessed
    ("optim.warmup_steps=400", "optim.warmup_steps=400"),
])
def test_a_hand_set_step_that_contradicts_the_checkpoint_is_refused_in_one_line(tmp_path, typed, named):
    path = _checkpoint(tmp_path, step=3250, start_step=100000)
    with pytest.raises(ValueError) as err:
        _settled(tmp_path, f"resume={path}", typed)
    message = str(err.value)
    assert named in message and "3250" in message and "\n" not in message, message


def test_values_that_agree_with_the_checkpoint_and_runs_that_are_not_forks_keep_their_steps(tmp_path):
    path = _checkpoint(tmp_path, step=3250, start_step=100000)
    cfg, _ = _settled(tmp_path, f"resume={path}", "dense_steps=3250", "trainer.max_steps=3300")
    assert (cfg.pruning.start_step, cfg.gated_steps, cfg.trainer.max_steps) == (3250, 50, 3300)
    # a dense model trained on to a fixed step (gating beyond the end): a dense run, its steps as given
    cfg, schedule = _settled(tmp_path, f"resume={path}", "pruning.start_step=1000000", "trainer.max_steps=5000")
    assert (cfg.pruning.start_step, cfg.trainer.max_steps, schedule["fork"]["step"]) == (1000000, 5000, 3250)
    assert (cfg.optim.warmup_steps, schedule["gated_steps"]) == (4000, 0)  # at the checkpoint's rate, nothing gated
    with pytest.raises(ValueError, match="trainer.max_steps=850 on a fork .* would end before it starts"):
        _settled(tmp_path, f"resume={path}", "pruning.start_step=1000000")
    # a last.ckpt inside a dense phase that went on, and a gated checkpoint: continued as configured
    gated = _default_gated_steps(tmp_path)
    for step, name in ((500, "last.ckpt"), (800, "gated.ckpt")):
        cfg, schedule = _settled(tmp_path, f"resume={_checkpoint(tmp_path, step, 750, name)}")
        assert (cfg.dense_steps, cfg.trainer.max_steps, cfg.optim.warmup_steps, schedule["fork"]) == (
            750, 750 + gated, 400, None)
    # no fork: gated_steps sets trainer.max_steps, which may not say otherwise
    cfg, _ = _settled(tmp_path, "gated_steps=300")
    assert cfg.trainer.max_steps == cfg.dense_steps + 300
    with pytest.raises(ValueError, match="trainer.max_steps=900 with gated_steps=300 .* is 1050"):
        _settled(tmp_path, "gated_steps=300", "trainer.max_steps=900")


# ---- the comparison presets: the same training after the dense checkpoint for every method ---------------------

HISTORIC = {"dense_850", "dense_950", "dense_1050"}


@pytest.mark.parametrize("typed", [(), ("gated_steps=250", "finetune_steps=40")])
def test_every_preset_trains_as_long_after_the_dense_checkpoint(tmp_path, typed):
    given = dict(o.split("=") for o in typed)
    gated = int(given.get("gated_steps", _default_gated_steps(tmp_path)))
    model = compose_train(tmp_path, SCRATCH).model.from_scratch
    every_head = (model.encoder_layers * model.encoder_attention_heads
                  + 2 * model.decoder_layers * model.decoder_attention_heads)  # decoder self- and cross-attention

    def after_dense(cfg) -> int:
        """Training steps after the dense checkpoint: a gated method's gated steps count, then its fine-tuning."""
        trains_gates = "start_step" in cfg.pruning
        return (cfg.gated_steps if trains_gates else 0) + cfg.finetune.steps

    def presets(experiment: str, group: str) -> dict:
        sweep = compose_train(tmp_path, f"experiment={experiment}", hydra_config=True).hydra.sweeper.params
        names = sweep[f"+{group}"].split(",")
        # every preset is swept, but the absolute lengths that reproduce docs/quality.md's 750-step runs
        assert sorted(names) == sorted(p.stem for p in (CONF / group).glob("*.yaml") if p.stem not in HISTORIC)
        return {n: compose_train(tmp_path, f"experiment={experiment}", f"+{group}={n}", *typed) for n in names}

    compare = presets("compare", "compare")
    tuned = int(given.get("finetune_steps", 0))
    assert {name: after_dense(cfg) for name, cfg in compare.items()} == {name: gated + tuned for name in compare}
    assert compare["l0_budget_24"].finetune.steps == tuned  # finetune.steps keeps its meaning: the export's fine-tuning
    assert compare["dense"].pruning.heads == every_head

    quality = presets("quality", "quality")
    tuned = int(given.get("finetune_steps", 100))
    converged = int(given.get("gated_steps", 300))  # at most: it stops once its plan is stable
    expected = {"plain": gated, "distill": gated, "finetune": gated + tuned, "distill_finetune": gated + tuned,
                "converged": converged, "dense_plain": gated, "dense_finetune": gated + tuned,
                "dense_distill_finetune": gated + tuned}
    assert {name: after_dense(cfg) for name, cfg in quality.items()} == expected
    for protocol, dense in (("finetune", "dense_finetune"), ("distill_finetune", "dense_distill_finetune")):
        ours, reference = quality[protocol], quality[dense]
        assert reference.pruning.heads == every_head and reference.finetune.lr == ours.finetune.lr
        assert (reference.finetune.distill, reference.pruning.distill.alpha) == (ours.finetune.distill,
                                                                                 ours.pruning.distill.alpha)


def test_finetune_steps_typed_with_a_comparison_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="finetune.steps=100 with a comparison preset.* allowed: finetune_steps=100"):
        _settled(tmp_path, "experiment=compare", "+compare=michel", "finetune.steps=100")


# ---- two tiny runs: a converged dense model, and a gated fork of its dense.ckpt ----------------------------------

def test_a_fork_of_a_converged_run_gates_from_its_step_on_its_schedule(tmp_path):
    """The dense run stops where its validation BLEU stopped improving (a step no config names, with warm-up 4); the
    fork (experiment=smoke: dense_steps 10, warm-up 10) gates 6 steps from there, at the checkpoint's learning rate."""
    dense = tmp_path / "dense"
    proc = run_train(dense, "callbacks=converge", "callbacks.converge.patience=1", "dense_steps=400",
                     "trainer.max_steps=400", "trainer.val_check_interval=6", "optim.warmup_steps=4",
                     "export.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = dense / "checkpoints" / "dense.ckpt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    n, optim = saved["global_step"], saved["hyper_parameters"]["optim"]
    assert n % 6 == 0 and n != 10  # stopped at a validation; not the smoke preset's dense phase

    # trainer.max_steps typed as if the dense phase were the preset's: refused before anything is written
    refused = run_train(tmp_path / "refused", f"resume={checkpoint}", "trainer.max_steps=30")
    line = error_line(refused)
    assert refused.returncode == 2 and "trainer.max_steps=30" in line and f"step {n}" in line, line
    assert not (tmp_path / "refused").exists()

    fork = tmp_path / "fork"
    proc = run_train(fork, f"resume={checkpoint}", "gated_steps=6", "export.enabled=false",
                     "trainer.log_every_n_steps=1",
                     "+callbacks.lr={_target_:lightning.pytorch.callbacks.LearningRateMonitor,logging_interval:step}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((fork / "metrics.json").read_text())
    schedule = json.loads((fork / "status.json").read_text())["schedule"]
    assert metrics["method"] == "gated" and metrics["steps"] == n + 6 and metrics["dense"]["step"] == n
    assert (schedule["start_step"], schedule["gated_steps"], schedule["fork"]["step"]) == (n, 6, n)
    rows = list(csv.DictReader((fork / "csv" / "metrics.csv").open()))
    assert sorted(int(r["step"]) for r in rows if r["train/penalty"]) == list(range(n, n + 6))  # steps n .. n+5
    # the first gated step's learning rate: linear warm-up then inverse square root, at the checkpoint's step n
    # (the scheduler has stepped n times) with the checkpoint's warm-up, not restarted nor at the fork's warm-up
    lr = next(float(r["lr-AdamW/pg1"]) for r in rows if r["lr-AdamW/pg1"] and int(r["step"]) == n)

    def rate(step: int, warmup: int) -> float:
        return optim["lr"] * min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))

    assert optim["warmup_steps"] == 4 and lr == pytest.approx(rate(n, 4), rel=1e-6)
    assert abs(rate(n, 4) - rate(n, 10)) > 0.1 * rate(n, 4) and abs(rate(n, 4) - rate(0, 4)) > 0.1 * rate(n, 4)


def test_a_fork_trains_its_gates_and_multipliers_at_its_own_rates(tmp_path):
    """The gates' and the budget's optimiser groups take the fork's pruning.gate_lr and lagrangian_lr, not the rates
    the checkpoint saved them with (0.1 and 0.05: a fork that set others silently kept those)."""
    budget = ("pruning=l0_budget", "pruning.target_heads=12")
    dense = tmp_path / "dense"
    proc = run_train(dense, *budget, "trainer.max_steps=10", "export.enabled=false")  # saves the budget's group too
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(dense / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)
    assert [g["lr"] for g in saved["optimizer_states"][0]["param_groups"][1:]] == [0.1, 0.05]
    fork = tmp_path / "fork"
    proc = run_train(fork, f"resume={dense / 'checkpoints' / 'dense.ckpt'}", *budget, "pruning.gate_lr=0.3",
                     "pruning.lagrangian_lr=0.7", "gated_steps=4", "export.enabled=false", "trainer.log_every_n_steps=1",
                     "+callbacks.lr={_target_:lightning.pytorch.callbacks.LearningRateMonitor,logging_interval:step}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in csv.DictReader((fork / "csv" / "metrics.csv").open()) if r.get("lr-AdamW/pg2")]
    assert rows and {(float(r["lr-AdamW/pg2"]), float(r["lr-AdamW/pg3"])) for r in rows} == {(0.3, 0.7)}
    last = torch.load(fork / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert [g["lr"] for g in last["optimizer_states"][0]["param_groups"][1:]] == [0.3, 0.7]
    assert last["lr_schedulers"][0]["base_lrs"][1:] == [0.3, 0.7]
