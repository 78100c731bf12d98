"""Distillation from the dense model while gating: the loss against its formula, a frozen teacher equal to the
dense model, and forks from a checkpoint written without a teacher."""

import math

import pytest
import torch

from helpers import compose_train
from gatedprune.distill import DistillOptions, kl_distillation
from gatedprune.train import train


def test_kl_distillation_against_its_formula():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    temperature = 2.0
    total, tokens = 0.0, 0
    for b in range(2):
        for t in range(3):
            if labels[b, t] == -100:
                continue
            p = torch.softmax(teacher[b, t] / temperature, -1)
            q = torch.softmax(student[b, t] / temperature, -1)
            total += float((p * (p.log() - q.log())).sum())
            tokens += 1
    assert kl_distillation(student, teacher, labels, temperature).item() == pytest.approx(
        temperature**2 * total / tokens, rel=1e-5)
    assert kl_distillation(teacher, teacher, labels, temperature).item() == pytest.approx(0.0, abs=1e-6)


def test_distill_options_are_checked():
    for bad in ({"alpha": 1.5}, {"temperature": 0.0}):
        with pytest.raises(ValueError, match="allowed: 0 <= alpha <= 1, temperature > 0"):
            DistillOptions(**bad)
    with pytest.raises(ValueError, match=r"pruning.distill.alpha=nan is not a finite number"):
        DistillOptions(alpha=math.nan)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "run"
    metrics = train(compose_train(out, "experiment=smoke", "pruning.distill.alpha=0.5", "export.enabled=false"))
    return out, metrics


def test_the_teacher_is_the_dense_model_frozen(distilled):
    out, metrics = distilled
    dense = torch.load(out / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    last = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    state = last["state_dict"]
    teacher = {k[len("teacher."):]: v for k, v in state.items() if k.startswith("teacher.")}
    assert teacher and last["teacher_ready"]
    # the teacher holds the weights of the end of the dense phase, untouched by 20 gated steps; the student moved
    assert all(torch.equal(v, dense[f"model.{k}"]) for k, v in teacher.items())
    assert any(not torch.equal(v, state[f"model.{k}"]) for k, v in teacher.items())
    assert metrics["distill"]["alpha"] == 0.5 and metrics["distill"]["teacher_ms_per_step"] > 0


def test_the_distilled_loss_is_the_weighted_sum(distilled, tmp_path):
    import csv

    out, _ = distilled
    rows = [r for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get("train/distill")]
    assert rows and all(int(r["step"]) >= 10 for r in rows)  # only gated steps distil
    # train/loss = 0.5 ce + 0.5 distill + penalty, as logged for the same step
    row = next(r for r in rows if r.get("train/loss") and r.get("train/ce") and r.get("train/penalty"))
    expected = 0.5 * float(row["train/ce"]) + 0.5 * float(row["train/distill"]) + 0.1 * float(row["train/penalty"])
    assert float(row["train/loss"]) == pytest.approx(expected, rel=1e-4)


def test_a_distilled_fork_starts_from_a_dense_checkpoint_written_without_a_teacher(distilled, tmp_path):
    plain = tmp_path / "plain"
    train(compose_train(plain, "experiment=smoke", "trainer.max_steps=10", "export.enabled=false"))
    fork = tmp_path / "fork"
    metrics = train(compose_train(fork, "experiment=smoke", "pruning.distill.alpha=0.5", "export.enabled=false",
                                  f"resume={plain / 'checkpoints' / 'dense.ckpt'}", "trainer.max_steps=14"))
    assert metrics["steps"] == 14 and metrics["distill"]["teacher_ms_per_step"] > 0
    dense = torch.load(plain / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    state = torch.load(fork / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.equal(state[f"teacher.{k[len('model.'):]}"], v) for k, v in dense.items() if k.startswith("model."))


def test_fine_tuning_the_exported_model_reloads_and_lowers_its_validation_loss(tmp_path):
    from gatedprune import load_pruned

    metrics = train(compose_train(tmp_path / "run", "experiment=smoke", "finetune.steps=10", "finetune.lr=1e-3"))
    tuned = metrics["finetune"]
    assert metrics["model"].startswith("exported, fine-tuned 10 steps") and tuned["steps"] == 10
    assert metrics["val_loss"] <= tuned["validation_before"]["loss"]  # the fine-tuned model, as reloaded and scored
    model = load_pruned(tuned["dir"])  # same pruned shapes as the export
    exported = load_pruned(tmp_path / "run" / "pruned")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in exported.parameters()) == metrics["params"]
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), exported.state_dict().values()))
    assert set(metrics["test"]) == {"dense", "pruned", "pruned_before_finetune"}


def test_fine_tuning_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="finetune.distill=true needs a teacher"):
        train(compose_train(tmp_path / "a", "experiment=smoke", "finetune.steps=5", "finetune.distill=true"))
    with pytest.raises(ValueError, match="allowed with export.enabled=true"):
        train(compose_train(tmp_path / "b", "experiment=smoke", "finetune.steps=5", "export.enabled=false"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
