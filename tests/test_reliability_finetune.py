"""Fine-tuning after pruning has the gated phase's guards (it never ships non-finite weights, and a failed fine-tune
fails the run with the verified export kept), and survives SIGTERM: it saves its state and the relaunch resumes it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, compose_train, error_line, offline_env, run_train, train_dense

FINETUNE = ["finetune.steps=60"]  # long enough to be interrupted once it has begun


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _weights(export: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}


# ---- item 3: a diverging fine-tune ships the verified export, fails the run, and writes no fine-tuned model -------

# weights that went non-finite while every loss and gradient was finite (AdamW cannot overflow them in one step,
# it moves a weight by at most lr): made so at the end of fine-tuning
INF_WEIGHTS = ["import gatedprune.shipping.finetune as f",
               "f.PrunedFineTuning.on_train_end = lambda self: next(self.model.parameters()).data.fill_(float('inf'))"]


@pytest.mark.parametrize("overrides, prefix, says", [
    # the last steps had a non-finite loss: the weights it ended with give none
    (["finetune.steps=5", "finetune.lr=1e8"], (), "non-finite loss or gradient"),
    # optim.max_bad_steps bad steps in a row stop it, as they stop the gated phase
    (["finetune.steps=40", "finetune.lr=1e8", "optim.max_bad_steps=2"], (), "2 steps in a row had a non-finite loss"),
    # weights that are not finite are never written
    (["finetune.steps=2"], INF_WEIGHTS, "are not finite"),
], ids=["last-steps-bad", "max-bad-steps", "weights-not-finite"])
def test_a_diverging_fine_tune_keeps_the_verified_export_and_fails_the_run(tmp_path, overrides, prefix, says):
    run_dir = tmp_path / "run"
    stale = run_dir / "pruned_finetuned"  # an earlier run's fine-tuned model, which metrics.json will not describe
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("an earlier run's")
    proc = run_train(run_dir, *overrides, prefix=prefix)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("error: fine-tuning") and says in line and "pruned as exported and verified" in line, line
    status = _json(run_dir / "status.json")
    assert status["status"] == "failed" and says in status["error"]
    assert not stale.exists() and not (run_dir / "checkpoints" / "finetune.ckpt").exists()
    assert not list(run_dir.glob(".pruned_finetuned*"))  # nothing half-written beside it either
    # the verified export is kept, with finite weights, and metrics.json describes it
    weights = _weights(run_dir / "pruned")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    metrics = _json(run_dir / "metrics.json")
    assert metrics["model"].startswith("exported (fine-tuning failed")
    assert says in metrics["finetune"]["error"] and metrics["export"]["verification"]["passed"]
    assert metrics["bleu"] == metrics["finetune"]["validation_before"]["bleu"]
    assert metrics["val_loss"] == metrics["finetune"]["validation_before"]["loss"]
    assert set(metrics["test"]) == {"dense", "pruned"}  # the export's test score, as shipped


def test_a_fine_tune_never_saves_weights_that_are_not_finite(tmp_path):
    from families import tiny_model
    from gatedprune.shipping.finetune import FineTuneConfig, PrunedFineTuning

    module = PrunedFineTuning(tiny_model("mbart", tmp_path), FineTuneConfig(steps=3, warmup_steps=0), 0.1)
    module.on_save_checkpoint({})  # finite: saved
    with torch.no_grad():
        next(module.model.parameters())[0] = float("inf")
    with pytest.raises(FloatingPointError, match="not finite"):
        module.on_save_checkpoint({})


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return train_dense(tmp_path_factory.mktemp("finetune") / "dense")


def test_a_baseline_level_whose_fine_tune_fails_is_recorded_and_the_other_levels_go_on(dense_run, tmp_path,
                                                                                     monkeypatch):
    import gatedprune.shipping.finetune as finetune_module
    from gatedprune.errors import RunFailed, exit_code
    from gatedprune.train import train

    real, first = finetune_module.token_cross_entropy, []

    def nan_for_the_first_level(model, batch, *args, **kwargs):
        first.append(model) if not first else None
        loss = real(model, batch, *args, **kwargs)
        return loss * float("nan") if model is first[0] else loss

    monkeypatch.setattr(finetune_module, "token_cross_entropy", nan_for_the_first_level)
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed) as failed:
        train(compose_train(run_dir, "experiment=smoke", f"resume={dense_run}", "pruning=random",
                            "pruning.heads=[12,6]", "finetune.steps=3"))
    assert exit_code(failed.value) == 1 and "\n" not in str(failed.value)
    assert "fine-tuning failed at 1 of 2 levels (12 heads)" in str(failed.value)
    bad, good = run_dir / "levels" / "012_heads", run_dir / "levels" / "006_heads"
    bad_metrics, good_metrics = _json(bad / "metrics.json"), _json(good / "metrics.json")
    assert (bad / "pruned").is_dir() and not (bad / "pruned_finetuned").exists()
    assert "non-finite" in bad_metrics["finetune"]["error"] and bad_metrics["model"].startswith("exported (fine-tuning failed")
    assert bad_metrics["bleu"] == bad_metrics["finetune"]["validation_before"]["bleu"]
    assert (good / "pruned_finetuned").is_dir() and "error" not in good_metrics["finetune"]
    assert good_metrics["model"].startswith("exported, fine-tuned 3 steps")
    summary = {level["heads"]: level for level in _json(run_dir / "metrics.json")["levels"]}
    assert "non-finite" in summary[12]["finetune_error"] and summary[12]["test_bleu_finetuned"] is None
    assert summary[12]["test_bleu"] == bad_metrics["test"]["pruned"]["bleu"]
    assert "finetune_error" not in summary[6] and summary[6]["test_bleu_finetuned"] is not None
    status = _json(run_dir / "status.json")
    assert status["status"] == "failed" and "12 heads" in status["error"]


# ---- item 9: SIGTERM during fine-tuning saves its state, and the relaunch resumes it ------------------------------

def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "experiment=smoke", f"hydra.run.dir={run_dir}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=offline_env(), cwd=run_dir.parent,
    )


def test_sigterm_during_fine_tuning_saves_it_and_the_relaunch_resumes_it_to_the_uninterrupted_result(tmp_path):
    reference = tmp_path / "reference"
    proc = run_train(reference, *FINETUNE)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "finetune.ckpt"
    proc = _start(run_dir, *FINETUNE)
    seen = []
    for line in proc.stdout:  # fine-tuning has begun (its SIGTERM handler is in place) once it says so
        seen.append(line)
        if "fine-tuning pruned_finetuned: 60 steps" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    status = _json(run_dir / "status.json")
    assert status["status"] == "interrupted" and f"saved {checkpoint}" in status["error"], status
    assert f"SIGTERM during fine-tuning: saved {checkpoint}" in out
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)  # tensors and plain data only
    stopped_at = saved["global_step"]
    assert 0 < stopped_at < 60 and saved["finetune"]["dir"] == "pruned_finetuned"  # Lightning stops after a batch
    assert not (run_dir / "pruned_finetuned").exists()

    proc = _start(run_dir, *FINETUNE)  # the same command: the gated phase is over, fine-tuning goes on
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"resuming fine-tuning from {checkpoint}" in out
    assert f"fine-tuning pruned_finetuned: 60 steps at lr 0.0001, resumed at step {stopped_at}" in out
    assert _json(run_dir / "status.json")["status"] == "done" and not checkpoint.exists()
    ours, theirs = _json(run_dir / "metrics.json"), _json(reference / "metrics.json")
    assert ours["finetune"]["steps"] == 60 and ours["plan"] == theirs["plan"]
    # same data order, dropout and optimiser state as the fine-tune that was never interrupted
    tuned, expected = _weights(run_dir / "pruned_finetuned"), _weights(reference / "pruned_finetuned")
    assert tuned.keys() == expected.keys()
    assert all(torch.allclose(tuned[k], expected[k], atol=1e-6) for k in expected)


def test_a_fine_tuning_checkpoint_of_another_fine_tune_is_not_resumed(tmp_path, capsys):
    from gatedprune.shipping.finetune import resume_point

    identity = {"dir": "pruned_finetuned", "plan": {"encoder": {"m": [0, 1]}}, "steps": 5, "lr": 1e-4,
                "distill": False, "seed": 0}
    path = tmp_path / "finetune.ckpt"
    assert resume_point(path, identity) is None  # none saved
    torch.save({"finetune": identity, "global_step": 2}, path)
    assert resume_point(path, identity) == path
    assert resume_point(path, {**identity, "lr": 1e-3}) is None
    assert "written by another fine-tune" in capsys.readouterr().out
    path.write_bytes(b"truncated")
    assert resume_point(path, identity) is None
    assert "not a readable fine-tuning checkpoint" in capsys.readouterr().out


def test_each_level_of_a_method_has_its_own_fine_tuning_checkpoint(tmp_path):
    # a relaunch fine-tunes the levels again in order: a shared file would be removed by the first level's finished
    # fine-tune before the interrupted level got to resume it
    from types import SimpleNamespace

    from gatedprune.shipping.finalise import _checkpoint

    run = tmp_path / "run"
    session = SimpleNamespace(run_dir=run, tuning=SimpleNamespace(out_dir=str(run / "pruned_finetuned")))
    assert _checkpoint(session, run / "pruned_finetuned") == run / "checkpoints" / "finetune.ckpt"
    levels = [_checkpoint(session, run / "levels" / f"{n:03d}_heads" / "pruned_finetuned") for n in (12, 6)]
    assert levels == [run / "checkpoints" / "finetune-levels-012_heads.ckpt",
                      run / "checkpoints" / "finetune-levels-006_heads.ckpt"]


def test_a_fine_tune_killed_with_sigkill_resumes_from_its_last_periodic_checkpoint_bit_identically(tmp_path):
    import time

    every = ["finetune.steps=40", "finetune.checkpoint_every=10", "finetune.warmup_steps=5", "finetune.decay=linear"]
    reference = tmp_path / "reference"
    proc = run_train(reference, *every)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (reference / "checkpoints" / "finetune.ckpt").exists()  # a finished fine-tune removes it

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "finetune.ckpt"
    proc = _start(run_dir, *every)
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
    proc.communicate(timeout=60)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["global_step"] % 10 == 0 and 0 < saved["global_step"] < 40
    assert not (run_dir / "pruned_finetuned").exists()

    proc = _start(run_dir, *every)  # the same command
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"resuming fine-tuning from {checkpoint}" in out and "resumed at step" in out
    assert not checkpoint.exists()
    tuned, expected = _weights(run_dir / "pruned_finetuned"), _weights(reference / "pruned_finetuned")
    assert tuned.keys() == expected.keys()
    assert all(torch.equal(tuned[k], expected[k]) for k in expected), "not bit-identical to the uninterrupted run"


def test_a_checkpoint_interval_beyond_250_or_below_1_is_refused(tmp_path):
    for bad in (0, 251):
        run_dir = tmp_path / f"run{bad}"
        proc = run_train(run_dir, "finetune.steps=20", f"finetune.checkpoint_every={bad}")
        assert proc.returncode == 2 and f"finetune.checkpoint_every={bad}; allowed: 1 to 250" in error_line(proc)
        assert not run_dir.exists()
