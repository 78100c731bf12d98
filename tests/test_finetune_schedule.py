"""Fine-tuning's learning-rate schedule (warm-up, peak, decay), its refusals, and the time it reports."""

from __future__ import annotations

import json
import math

import pytest

from helpers import refused_at_setup, run_train


def _expected(step: int, steps: int, warmup: int, decay: str, peak: float) -> float:
    """The schedule written out again, independently of gatedprune's."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done, span = step - warmup, steps - warmup
    return peak * {"constant": 1.0, "linear": 1 - done / span, "cosine": (1 + math.cos(math.pi * done / span)) / 2,
                   "inverse_sqrt": math.sqrt(max(warmup, 1) / (step + 1))}[decay]


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine", "inverse_sqrt"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_the_optimiser_steps_at_the_schedules_rate(tmp_path, decay, warmup):
    import torch

    from families import tiny_model
    from gatedprune.shipping.finetune import FineTuneConfig, PrunedFineTuning

    steps, peak = 20, 3e-4
    module = PrunedFineTuning(tiny_model("mbart", tmp_path), FineTuneConfig(steps=steps, lr=peak, warmup_steps=warmup,
                                                                         decay=decay), 0.1)
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx([_expected(k, steps, warmup, decay, peak) for k in range(steps)], rel=1e-9)
    assert max(rates) == pytest.approx(peak)
    assert isinstance(optimizer, torch.optim.AdamW)


@pytest.mark.parametrize("overrides, says", [
    (["finetune.warmup_steps=50", "finetune.steps=20"], "finetune.warmup_steps=50 with finetune.steps=20"),
    (["finetune.warmup_steps=-1", "finetune.steps=20"], "finetune.warmup_steps=-1"),
    (["finetune.decay=exponential", "finetune.steps=20"], "finetune.decay='exponential'; allowed: constant, linear"),
    (["finetune.steps=-5"], "finetune.steps=-5"),
])
def test_bad_schedules_are_refused_in_one_line_before_anything_runs(tmp_path, overrides, says):
    assert says in refused_at_setup(tmp_path / "run", *overrides)


def test_a_fine_tune_reports_its_time_and_schedule(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "finetune.steps=6", "finetune.warmup_steps=2", "finetune.decay=linear")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    tuned = metrics["finetune"]
    # the training phases before it too: every step of the run, in this process
    trained = json.loads((run_dir / "status.json").read_text())["schedule"]["max_steps"]
    assert metrics["seconds"]["steps_timed"] == trained
    assert metrics["seconds"]["s_per_step"] == pytest.approx(metrics["seconds"]["method"] / trained, rel=0.01)
    assert tuned["warmup_steps"] == 2 and tuned["decay"] == "linear" and tuned["steps_timed"] == 6
    # both are rounded (wall_s to 0.01 s, s_per_step to 0.1 ms): a phase of a third of a second is 1.5% off by that
    assert tuned["wall_s"] > 0 and tuned["s_per_step"] * 6 == pytest.approx(tuned["wall_s"], abs=0.005 + 6 * 0.00005)
    assert "fine-tuning pruned_finetuned: 6 steps at lr 0.0001 (2 warm-up, linear)" in proc.stdout
    # one bar over the phase's steps (not Lightning's per-epoch one), ending at the last step
    bars = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.startswith("fine-tuning:")]
    assert bars and "6/6" in bars[-1] and "100%" in bars[-1], bars[-3:]
    assert "Epoch" not in proc.stderr[proc.stderr.index("fine-tuning:"):]
