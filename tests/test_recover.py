"""``gatedprune-finetune PRUNED_DIR --teacher DIR`` (``pruning=recover``): an export made before, fine-tuned on the
trainer's data with its teacher, without running the gates again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import error_line, offline_env, run_train


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A smoke run's uneven export (10 of 24 heads), and a dense teacher of the same vocabulary."""
    from transformers import AutoTokenizer

    from families import save_plain_mbart

    root = tmp_path_factory.mktemp("recover")
    run_dir = root / "run"
    proc = run_train(run_dir, "finetune.steps=0", "export.rule=top-k", "export.top_k=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    teacher = root / "teacher"
    save_plain_mbart(teacher, tokenizer, width=32, seed=5)
    tokenizer.save_pretrained(teacher)
    return run_dir / "pruned", teacher


def _finetune(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gatedprune", "finetune", *args, "experiment=smoke"],
                          capture_output=True, text=True, env=offline_env(), cwd=cwd, timeout=300)


def test_an_export_is_fine_tuned_from_its_teacher_without_the_gates(made, tmp_path):
    import torch
    from safetensors.torch import load_file

    from gatedprune.surgery.model_loading import load_pruned

    pruned, teacher = made
    out = tmp_path / "recovered"
    proc = _finetune(str(pruned), "--teacher", str(teacher), "--out", str(out), "finetune.steps=4",
                     "finetune.val_check_interval=2", "finetune.targets=dense_greedy", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"] == "recover" and metrics["pruned"] == str(pruned) and metrics["teacher"] == str(teacher)
    tuned = metrics["finetune"]
    assert tuned["targets"] == "dense_greedy" and [p["step"] for p in tuned["curve"]] == [2, 4]
    assert not (out / "checkpoints" / "last.ckpt").exists()  # no gated phase ran
    # the shipped model has the export's shapes (10 heads, uneven), and weights the fine-tune moved
    before, after = load_file(str(pruned / "model.safetensors")), load_file(str(out / "pruned_finetuned" /
                                                                                  "model.safetensors"))
    assert {k: v.shape for k, v in before.items()} == {k: v.shape for k, v in after.items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)
    plan = json.loads((pruned / "config.json").read_text())["gatedprune"]["kept_heads"]
    assert sum(len(h) for kind in plan.values() for h in kind.values()) == 10
    assert load_pruned(out / "pruned_finetuned").config.gatedprune["kept_heads"] == plan
    # the targets are the teacher's translations, one per training pair, cached in the run directory
    caches = list((out / "cache").glob("seqkd-*.jsonl"))
    assert len(caches) == 1
    assert metrics["dense"]["validation"]["sentences"] > 0 and metrics["test"]["pruned"]["bleu"] >= 0
    assert "fine-tuned (step" in proc.stdout and "teacher" in proc.stdout


@pytest.mark.parametrize("which, extra, says", [
    ("teacher", ["finetune.steps=4"], "not a pruned export (no config.json with a gatedprune plan)"),
    ("pruned", ["finetune.steps=0"], "pruning=recover with finetune.steps=0: nothing to do"),
    ("pruned", ["finetune.steps=4", "export.enabled=false"], "pruning=recover with export.enabled=false"),
])
def test_bad_recoveries_are_refused_in_one_line_and_leave_nothing(made, tmp_path, which, extra, says):
    pruned, teacher = made
    out = tmp_path / "recovered"
    proc = _finetune(str(pruned if which == "pruned" else teacher), "--teacher", str(teacher), "--out", str(out),
                     *extra, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in error_line(proc)
    assert not out.exists()


def test_the_teacher_is_required(made, tmp_path):
    proc = _finetune(str(made[0]), cwd=tmp_path)
    assert proc.returncode == 2 and "--teacher" in proc.stderr


def test_the_teacher_can_be_a_dense_run_of_train_py(made, tmp_path):
    from helpers import train_dense

    dense = train_dense(tmp_path / "dense")
    out = tmp_path / "recovered"
    proc = _finetune(str(made[0]), "--teacher", str(dense), "--out", str(out), "finetune.steps=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["teacher"] == str(dense / "checkpoints" / "last.ckpt")
    # the teacher scored is the dense run's model: its test loss, as that run scored it
    scored = json.loads((dense / "metrics.json").read_text())["test"]["dense"]
    assert metrics["dense"]["test"]["loss"] == pytest.approx(scored["loss"], rel=1e-6)
