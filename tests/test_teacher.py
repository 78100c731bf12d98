"""The kept teacher (teacher/): it is what teacher.json says (sha256, score), any run starts from it by name
(model=teacher), and scripts/make_teacher.py writes one from a converged run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, compose_train, error_line, offline_env, run_train, train_dense


def _files(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in directory.iterdir()}


def test_the_kept_teacher_is_what_its_record_says_and_scores_it():
    from gatedprune.reports.evaluate import evaluate_dir
    from gatedprune.teacher import RECORD, SCORED_PAIRS, TEACHER_DIR, WEIGHTS, record, sha256
    from gatedprune.surgery.model_loading import load_seq2seq

    made = record()
    assert (TEACHER_DIR / RECORD).is_file() and made["sha256"][WEIGHTS] == sha256(TEACHER_DIR / WEIGHTS)
    # at most 32 MB with its tokenizer, in git
    assert sum(p.stat().st_size for p in TEACHER_DIR.iterdir()) <= 32_000_000
    model = load_seq2seq(TEACHER_DIR)
    assert sum(p.numel() for p in model.parameters()) == made["parameters"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scored = evaluate_dir(TEACHER_DIR, "test", [f"data.max_test_pairs={SCORED_PAIRS}"])
    finally:
        torch.set_num_threads(threads)
    assert scored["sentences"] == SCORED_PAIRS
    assert abs(scored["bleu"] - made[f"test_bleu_first_{SCORED_PAIRS}_one_thread"]) <= 0.1, scored["bleu"]


def test_model_teacher_starts_from_the_kept_teacher_without_a_dense_phase():
    from gatedprune.teacher import TEACHER_DIR
    from gatedprune.training import schedule

    cfg = compose_train("/tmp/unused", "model=teacher", hydra_config=True)
    assert cfg.model.name_or_path == str(TEACHER_DIR) and cfg.data.tokenizer_path == str(TEACHER_DIR)
    assert cfg.dense_steps == 0 and cfg.pruning.start_step == 0
    settled = schedule.settle(cfg, Path("/tmp/unused"))
    # the default run's gated phase from the teacher: pruning=first_layers holds its widths from step 200 of 300
    assert settled["start_step"] == 0 and settled["gated_steps"] == 300 and cfg.trainer.max_steps == 300


@pytest.fixture(scope="module")
def small_teacher(tmp_path_factory) -> Path:
    """A teacher made by scripts/make_teacher.py from a smoke run's dense phase."""
    root = tmp_path_factory.mktemp("teacher")
    run = train_dense(root / "dense")
    out = root / "teacher"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_teacher.py"), str(run), "--out", str(out),
                           "experiment=smoke"], capture_output=True, text=True, env=offline_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_make_teacher_writes_the_converged_runs_dense_model_with_its_record(small_teacher):
    from gatedprune.reports.evaluate import evaluate_dir
    from gatedprune.teacher import sha256

    made = json.loads((small_teacher / "teacher.json").read_text())
    assert made["steps"] == 10 and made["sha256"]["model.safetensors"] == sha256(small_teacher / "model.safetensors")
    # the weights are the dense checkpoint's, exactly
    saved = torch.load(small_teacher.parent / "dense" / "checkpoints" / "dense.ckpt", map_location="cpu",
                       weights_only=True)["state_dict"]
    weights = load_file(small_teacher / "model.safetensors")
    assert weights and all(torch.equal(w, saved[f"model.{k}"]) for k, w in weights.items())
    # its scores are gatedprune-evaluate's on the same data
    again = evaluate_dir(small_teacher, "validation", ["experiment=smoke"])
    assert again["bleu"] == made["validation_bleu"] and made["validation_pairs"] == again["sentences"] == 40


def test_make_teacher_refuses_a_run_without_a_dense_checkpoint_and_an_existing_teacher(small_teacher, tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "make_teacher.py")]
    proc = subprocess.run([*script, str(tmp_path), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env=offline_env(), timeout=120)
    assert proc.returncode == 2 and "dense.ckpt does not exist" in error_line(proc)
    assert not (tmp_path / "out").exists()
    before = _files(small_teacher)
    proc = subprocess.run([*script, str(small_teacher.parent / "dense"), "--out", str(small_teacher),
                           "experiment=smoke"], capture_output=True, text=True, env=offline_env(), timeout=120)
    assert proc.returncode == 2 and "exists and is not empty" in error_line(proc)
    assert _files(small_teacher) == before


def test_a_run_from_a_teacher_by_path_trains_no_dense_phase_and_writes_nothing_into_it(small_teacher, tmp_path):
    before = _files(small_teacher)
    run_dir = tmp_path / "run"
    # experiment=smoke comes after the model in the defaults, so its dense_steps is given again here
    proc = run_train(run_dir, "model=teacher", f"model.name_or_path={small_teacher}", "dense_steps=0",
                     "gated_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["schedule"]["start_step"] == 0 and status["schedule"]["max_steps"] == 3
    assert _files(small_teacher) == before  # caches (the latency fit, targets) live in the run directory


def test_model_teacher_without_a_kept_teacher_is_one_line(tmp_path):
    script = ("import gatedprune.teacher as t, pathlib; t.TEACHER_DIR = pathlib.Path('/nonexistent/teacher')",)
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "model=teacher", "dense_steps=0", prefix=script)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc)
    assert "no kept teacher at /nonexistent/teacher" in line and "scripts/make_teacher.py" in line
    assert not run_dir.exists()
