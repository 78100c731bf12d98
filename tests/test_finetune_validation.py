"""Validation during fine-tuning (curve, best weights shipped, patience, snapshots) and finetune.init=scratch."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest

from helpers import refused_at_setup, run_train


def _weights(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_best_validation_is_shipped_and_the_curve_is_logged(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "finetune.steps=6", "finetune.val_check_interval=2", "finetune.save_at=[2,4,6]",
                     "finetune.lr=3e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    tuned = metrics["finetune"]
    curve = tuned["curve"]
    assert [p["step"] for p in curve] == [2, 4, 6]
    # the rule written out again: the highest BLEU, the lowest loss among equal BLEU
    best = max(curve, key=lambda p: (p["bleu"], -p["loss"]))
    assert tuned["shipped_step"] == tuned["best_step"] == best["step"]
    # the shipped weights are the snapshot of that step, bit for bit, and differ from another step's
    shipped = _weights(run_dir / "pruned_finetuned")
    assert _equal(shipped, _weights(run_dir / f"pruned_finetuned_step{best['step']}"))
    other = next(p["step"] for p in curve if p["step"] != best["step"])
    assert not _equal(shipped, _weights(run_dir / f"pruned_finetuned_step{other}"))
    # the shipped model's validation score, reloaded from its directory, is the curve's point
    assert metrics["val_loss"] == pytest.approx(best["loss"], rel=1e-5)
    assert metrics["bleu"] == pytest.approx(best["bleu"])
    # the CSV log holds the curve at the run's step: the gated phase's last step plus the fine-tune's
    gated_steps = json.loads((run_dir / "status.json").read_text())["schedule"]["max_steps"]
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("finetune/val_bleu")]
    offsets = {int(r["step"]) - p["step"] for r, p in zip(rows, curve)}
    assert len(rows) == 3 and len(offsets) == 1
    assert [float(r["finetune/val_loss"]) for r in rows] == pytest.approx([p["loss"] for p in curve], rel=1e-5)
    assert offsets == {gated_steps}
    assert f"fine-tuning ships the weights of step {best['step']}" in proc.stdout


def _validate(scores: list[tuple[float, float]], patience: int | None, every: int = 10, steps: int = 100):
    """Drive ``FineTuneValidation`` through a fake trainer, the model scoring ``scores`` in turn (BLEU, loss)."""
    import torch

    from gatedprune.shipping.finetune_validation import FineTuneValidation

    model = torch.nn.Linear(2, 2)
    results = iter(scores)
    validation = FineTuneValidation(lambda m: dict(zip(("bleu", "loss"), next(results)), chrf=0.0), every, patience)
    trainer = SimpleNamespace(global_step=0, max_steps=steps, should_stop=False)
    module = SimpleNamespace(model=model, config=SimpleNamespace(steps=steps))
    weights = {}
    while not trainer.should_stop and trainer.global_step < steps:
        trainer.global_step += 1
        with torch.no_grad():
            model.weight.fill_(trainer.global_step)  # the weights say which step they are from
        validation.on_train_batch_end(trainer, module, None, None, 0)
        weights[trainer.global_step] = model.weight.clone()
    return validation, trainer, model


def test_patience_stops_after_that_many_validations_without_a_gain():
    validation, trainer, model = _validate([(1.0, 5.0), (3.0, 4.0), (2.0, 3.0), (3.0, 4.5), (9.0, 1.0)], patience=2)
    assert trainer.should_stop and trainer.global_step == 40  # best at 20; 30 and 40 gained nothing
    assert validation.record() == {"curve": validation.curve, "best_step": 20, "stopped_early_at": 40}
    assert validation.restore_best(model)["step"] == 20
    assert float(model.weight[0, 0].detach()) == 20.0  # the weights of step 20 are back


def test_a_patience_stop_holds_after_a_resume_from_the_step_it_stopped_at():
    from gatedprune.shipping.finetune_validation import FineTuneValidation

    validation, trainer, _ = _validate([(2.0, 1.0), (1.0, 1.0)], patience=1)
    assert validation.stopped_at == 20
    resumed = FineTuneValidation(lambda m: {}, 10, 1)
    resumed.load_state_dict(validation.state_dict())  # what a checkpoint of step 20 holds
    again = SimpleNamespace(should_stop=False)
    resumed.on_train_start(again, None)
    assert again.should_stop and resumed.best["step"] == 10


def test_an_equal_bleu_at_a_lower_loss_is_a_gain_and_the_last_step_is_validated():
    validation, trainer, _ = _validate([(1.0, 5.0), (1.0, 4.0), (1.0, 4.0), (0.5, 1.0)], patience=None, every=30,
                                       steps=95)
    assert [p["step"] for p in validation.curve] == [30, 60, 90, 95]
    assert validation.best["step"] == 60 and not trainer.should_stop


@pytest.mark.parametrize("overrides, says", [
    (["finetune.val_check_interval=0"], "finetune.val_check_interval=0; allowed: a number of steps >= 1"),
    (["finetune.patience=3"], "finetune.patience=3 with finetune.val_check_interval=null; allowed"),
    (["finetune.steps=10", "finetune.save_at=[5,20]"], "finetune.save_at=[5, 20] with finetune.steps=10"),
    (["finetune.init=random"], "finetune.init='random'; allowed: export, scratch"),
])
def test_bad_validation_settings_are_refused_in_one_line_before_anything_runs(tmp_path, overrides, says):
    assert says in refused_at_setup(tmp_path / "run", *overrides)


def test_reinitialise_draws_every_weight_again_as_the_family_initialises(tmp_path):
    import torch

    from families import tiny_model
    from gatedprune.shipping.reinit import reinitialise

    model = tiny_model("bart", tmp_path)
    with torch.no_grad():  # weights unlike any initialisation: a trained model's
        for p in model.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reinitialise(model, seed=3)
    std = model.config.init_std
    for name, tensor in model.state_dict().items():
        if name.endswith("final_logits_bias") or name.endswith(".bias") and "layer_norm" not in name \
                and "layernorm" not in name:
            assert torch.all(tensor == 0), name  # BART's biases start at 0
        elif "layer_norm" in name or "layernorm" in name:
            assert torch.all(tensor == (1 if name.endswith("weight") else 0)), name
        else:  # normal(0, init_std): the sample's mean and spread, not the weights that were there
            assert not torch.equal(tensor, before[name]), name
            assert abs(float(tensor.mean())) < 4 * std and 0.7 * std < float(tensor.std()) < 1.3 * std, name
    assert model.lm_head.weight.data_ptr() == model.model.shared.weight.data_ptr()  # still tied
    again = reinitialise(tiny_model("bart", tmp_path / "again"), seed=3)
    assert _equal(dict(model.state_dict()), dict(again.state_dict()))  # the seed decides the weights


def test_init_scratch_fine_tunes_the_pruned_shapes_from_new_weights(tmp_path):
    from gatedprune.shipping.reinit import reinitialise
    from gatedprune.surgery.model_loading import load_pruned

    run_dir = tmp_path / "run"
    # a learning rate too small to move a weight in float32: what is shipped is what the fine-tune started from
    proc = run_train(run_dir, "finetune.steps=1", "finetune.init=scratch", "finetune.lr=1e-30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tuned = json.loads((run_dir / "metrics.json").read_text())["finetune"]
    assert tuned["init"] == "scratch"
    export, shipped = _weights(run_dir / "pruned"), _weights(run_dir / "pruned_finetuned")
    assert {k: v.shape for k, v in export.items()} == {k: v.shape for k, v in shipped.items()}  # the pruned shapes
    import torch

    assert not any(torch.equal(export[k], shipped[k]) for k in export if "weight" in k and "norm" not in k)
    seed = json.loads((run_dir / "metrics.json").read_text())["seed"]
    expected = reinitialise(load_pruned(run_dir / "pruned"), seed=seed)
    reference = {k: v for k, v in expected.state_dict().items() if k in shipped}
    assert reference.keys() == shipped.keys()
    # equal but for the one step at 1e-30 (it moves a weight at 0, a bias, by about that much)
    assert all(torch.allclose(reference[k], shipped[k], rtol=0, atol=1e-25) for k in reference)
