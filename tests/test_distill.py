"""Distillation from the dense model while gating: the loss against its formula, a frozen teacher equal to the
dense model, and forks from a checkpoint written without a teacher."""

import math

import pytest
import torch

from helpers import compose_train
from types import SimpleNamespace

from gatedprune.training.distill import DistillOptions, hidden_distillation, kl_distillation
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


def test_hidden_distillation_against_its_formula():
    torch.manual_seed(0)
    d = 4
    source_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # (B, S)
    labels = torch.tensor([[5, -100], [6, 7]])  # (B, T)
    student = SimpleNamespace(encoder_hidden_states=[torch.randn(2, 3, d) for _ in range(3)],
                              decoder_hidden_states=[torch.randn(2, 2, d) for _ in range(3)])
    teacher = SimpleNamespace(encoder_hidden_states=[torch.randn(2, 3, d) for _ in range(3)],
                              decoder_hidden_states=[torch.randn(2, 2, d) for _ in range(3)])
    per_layer = []
    for side, mask in (("encoder_hidden_states", source_mask), ("decoder_hidden_states", labels != -100)):
        for layer in (1, 2):  # the embeddings (0) are left out
            s, t = getattr(student, side)[layer], getattr(teacher, side)[layer]
            cells = [float(((s[b, i] - t[b, i]) ** 2).sum()) for b in range(2) for i in range(s.shape[1]) if mask[b, i]]
            per_layer.append(sum(cells) / (len(cells) * d))
    assert hidden_distillation(student, teacher, source_mask, labels != -100).item() == pytest.approx(
        sum(per_layer) / len(per_layer), rel=1e-5)
    assert hidden_distillation(student, student, source_mask, labels != -100).item() == 0.0


def test_distill_options_are_checked():
    for bad in ({"alpha": 1.5}, {"temperature": 0.0}, {"hidden": -1.0}):
        with pytest.raises(ValueError, match="allowed: 0 <= alpha <= 1, temperature > 0, hidden >= 0"):
            DistillOptions(**bad)
    with pytest.raises(ValueError, match=r"pruning.distill.alpha=nan is not a finite number"):
        DistillOptions(alpha=math.nan)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "run"
    metrics = train(compose_train(out, "experiment=smoke", "pruning.distill.alpha=0.5", "pruning.distill.hidden=2.0",
                                  "export.enabled=false"))
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
    assert metrics["distill"]["alpha"] == 0.5 and metrics["distill"]["hidden"] == 2.0
    assert metrics["distill"]["teacher_ms_per_step"] > 0


def test_the_distilled_loss_is_the_weighted_sum(distilled, tmp_path):
    import csv

    out, _ = distilled
    rows = [r for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get("train/distill")]
    assert rows and all(int(r["step"]) >= 10 for r in rows)  # only gated steps distil
    # train/loss = 0.5 ce + 0.5 distill + 2 hidden + penalty, as logged for the same step
    row = next(r for r in rows if r.get("train/loss") and r.get("train/ce") and r.get("train/penalty"))
    assert float(row["train/distill_hidden"]) > 0  # the student has moved away from the teacher
    expected = (0.5 * float(row["train/ce"]) + 0.5 * float(row["train/distill"]) + 2.0 * float(row["train/distill_hidden"])
                + 0.1 * float(row["train/penalty"]))
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


def test_fine_tuning_the_exported_model_reloads_and_lowers_its_validation_loss(tmp_path, capsys):
    import re

    from gatedprune import load_pruned

    metrics = train(compose_train(tmp_path / "run", "experiment=smoke", "finetune.steps=10", "finetune.lr=1e-3"))
    # the run ends with the table of the README's default run: the export as verified, then fine-tuned
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.lstrip().startswith("dense (step"))
    assert re.split(r"\s{2,}", header.strip()) == ["dense (step 10)", "gated (step 30)", "exported",
                                                   "exported + fine-tuned"]
    rows = {cells[0]: cells[1:] for line in printed.splitlines()
            if len(cells := re.split(r"\s{2,}", line.strip())) == 5 and cells[0].startswith(("validation", "test"))}
    test = metrics["test"]
    assert rows["validation BLEU"] == [f"{v:.2f}" for v in (metrics["dense"]["bleu"], metrics["gated"]["bleu"],
                                                             metrics["finetune"]["validation_before"]["bleu"],
                                                             metrics["bleu"])]
    assert rows["test BLEU"] == ["%.2f" % test["dense"]["bleu"], "-", "%.2f" % test["pruned_before_finetune"]["bleu"],
                                 "%.2f" % test["pruned"]["bleu"]]
    tuned = metrics["finetune"]
    assert metrics["model"].startswith("exported, fine-tuned 10 steps") and tuned["steps"] == 10
    assert metrics["val_loss"] <= tuned["validation_before"]["loss"]  # the fine-tuned model, as reloaded and scored
    model = load_pruned(tuned["dir"])  # same pruned shapes as the export
    exported = load_pruned(tmp_path / "run" / "pruned")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in exported.parameters()) == metrics["params"]
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), exported.state_dict().values()))
    assert set(metrics["test"]) == {"dense", "pruned", "pruned_before_finetune"}


def test_fine_tuning_options_are_checked(tmp_path, capsys):
    with pytest.raises(ValueError, match="finetune.distill=true needs a teacher"):
        train(compose_train(tmp_path / "a", "experiment=smoke", "finetune.steps=5", "finetune.distill=true"))
    assert not (tmp_path / "a").exists()
    # without an export there is no model to fine-tune: said, and the run is a gated run without one
    metrics = train(compose_train(tmp_path / "b", "experiment=smoke", "finetune.steps=5", "export.enabled=false",
                                  "trainer.max_steps=12"))
    assert "finetune" not in metrics and not (tmp_path / "b" / "pruned_finetuned").exists()
    assert "nothing is fine-tuned (finetune.steps=5 does not apply)" in capsys.readouterr().out


def test_the_default_run_recovers_the_kept_teacher_s_export_and_the_measured_presets_keep_their_fine_tune():
    from helpers import compose_train as compose

    from gatedprune.teacher import TEACHER_DIR

    default = compose("/tmp/unused")
    assert default.model.name_or_path == str(TEACHER_DIR) and default.dense_steps == 0  # no dense phase
    # docs/recovery.md's recipe: the probe's peak after a warm-up, inverse square root, validation every 250 steps;
    # 800 steps in the default run (finetune=default_run: with its 300 gated steps, its reference's 1,100), 1,000 else
    tuning = default.finetune
    assert (tuning.steps, tuning.lr, tuning.warmup_steps, tuning.decay, tuning.val_check_interval) == (
        800, 2e-3, 100, "inverse_sqrt", 250)
    assert compose("/tmp/unused", "finetune=default").finetune.steps == 1000
    for preset in ("experiment=smoke", "experiment=lambda_sweep", "experiment=compare", "+quality=plain"):
        assert compose("/tmp/unused", preset).finetune.steps == 0, preset
    # the pages measured before keep their model (trained from scratch) and their fine-tune (finetune=short)
    for preset in ("experiment=quality", "experiment=compare", "experiment=smoke"):
        cfg = compose("/tmp/unused", preset)
        assert cfg.model.name_or_path is None and cfg.model.from_scratch is not None, preset
        assert (cfg.finetune.lr, cfg.finetune.warmup_steps, cfg.finetune.decay, cfg.finetune.val_check_interval) == (
            1e-4, 0, "constant", None), preset
    assert compose("/tmp/unused", "experiment=converge").model.from_scratch is not None


def test_the_distilled_loss_of_a_pruned_student_against_its_parts(tmp_path):
    """distilled_loss on a physically pruned student (one layer without self-attention heads) against the unpruned
    teacher: (1 - alpha) CE + alpha KL + hidden MSE, each part computed here from the two models' own outputs."""
    import copy

    import torch.nn.functional as F

    from families import tiny_model
    from gatedprune.training.distill import distilled_loss
    from gatedprune.surgery.cut import prune_heads

    teacher = tiny_model("bart", tmp_path)
    student = prune_heads(copy.deepcopy(teacher), {"model.encoder.layers.0.self_attn": [],
                                                   "model.decoder.layers.1.encoder_attn": [0, 3]}).train()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 97, (2, 6), generator=generator)  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0
    labels = torch.randint(3, 97, (2, 5), generator=generator)  # (B, T)
    labels[0, 3:] = -100
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    options = DistillOptions(alpha=0.3, temperature=2.0, hidden=0.7)

    ce, loss, logs = distilled_loss(student, teacher, batch, options, label_smoothing=0.1)
    loss.backward()

    decoder_input_ids = student.prepare_decoder_input_ids_from_labels(labels=labels)
    with torch.no_grad():
        s = student(input_ids, attention_mask, decoder_input_ids=decoder_input_ids, output_hidden_states=True)
        t = teacher.eval()(input_ids, attention_mask, decoder_input_ids=decoder_input_ids, output_hidden_states=True)
    expected_ce = F.cross_entropy(s.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=0.1)
    expected_hidden = hidden_distillation(s, t, attention_mask, labels != -100)
    expected_kd = kl_distillation(s.logits, t.logits, labels, 2.0)
    assert ce.item() == pytest.approx(expected_ce.item(), rel=1e-5)
    assert logs["distill_hidden"].item() == pytest.approx(expected_hidden.item(), rel=1e-5) and expected_hidden > 0
    assert loss.item() == pytest.approx((0.7 * expected_ce + 0.3 * expected_kd + 0.7 * expected_hidden).item(), rel=1e-5)
    # the teacher is frozen: no gradient reaches it and its weights are unchanged; the student's weights get one
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert student.model.encoder.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
