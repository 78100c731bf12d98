"""Runs that survive interruption, skip non-finite steps, and repeat themselves exactly."""

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_train, gated_module, offline_env

SMOKE = ["experiment=smoke", "trainer.max_steps=40", "export.enabled=false"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = offline_env()
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *SMOKE, f"hydra.run.dir={run_dir}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=run_dir.parent,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _log_alpha(checkpoint: Path) -> torch.Tensor:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return torch.cat([state[k] for k in sorted(state) if k.endswith(".log_alpha")])


def _step(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]


def _wait_for_checkpoint(proc: subprocess.Popen, checkpoint: Path, min_step: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        try:
            if checkpoint.is_file() and _step(checkpoint) >= min_step:
                return
        except Exception:  # caught mid-write (should not happen: writes are atomic) or still empty
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no checkpoint of step >= {min_step} at {checkpoint}")


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """``reference(start_step)``: the uninterrupted smoke run with that dense phase (each run once)."""
    runs = {}

    def get(start_step: int) -> Path:
        if start_step not in runs:
            runs[start_step] = tmp_path_factory.mktemp(f"reference{start_step}") / "run"
            _finish(_start(runs[start_step], f"pruning.start_step={start_step}"))
        return runs[start_step]

    return get


@pytest.fixture
def reference_run(reference_runs) -> Path:
    return reference_runs(10)


def test_same_seed_same_gates_and_plan(reference_run, tmp_path):
    run_dir = tmp_path / "again"
    _finish(_start(run_dir))
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (reference_run, run_dir))
    assert a["plan"] == b["plan"] and a["seed"] == 1234 and "torch" in a["versions"]
    assert torch.equal(_log_alpha(reference_run / "checkpoints/last.ckpt"), _log_alpha(run_dir / "checkpoints/last.ckpt"))
    trajectory = [
        [line.split(",") for line in (d / "csv" / "metrics.csv").read_text().splitlines()] for d in (reference_run, run_dir)
    ]
    assert trajectory[0] == trajectory[1]


# SIGKILL in the dense phase (gating starts at step 25, after the resume), SIGTERM in the gated phase
@pytest.mark.parametrize("how, start_step", [(signal.SIGKILL, 25), (signal.SIGTERM, 10)])
def test_killed_run_resumes_to_the_uninterrupted_result(reference_runs, tmp_path, how, start_step):
    reference_run = reference_runs(start_step)
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    proc = _start(run_dir, f"pruning.start_step={start_step}")
    _wait_for_checkpoint(proc, checkpoint, min_step=20)
    proc.send_signal(how)
    out, _ = proc.communicate(timeout=120)
    if how == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert json.loads((run_dir / "status.json").read_text())["status"] == "interrupted"
        assert "SIGTERM: saved" in out
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "metrics.json").exists()
    stopped_at, saved_log_alpha = _step(checkpoint), _log_alpha(checkpoint)
    assert 20 <= stopped_at < 40

    out = _finish(_start(run_dir, f"pruning.start_step={start_step}"))  # same run dir: resume=auto continues
    assert f"resuming from {checkpoint}" in out
    assert f"resumed at step {stopped_at}: gates restored (sum of log_alpha {saved_log_alpha.sum().item():.6f}" in out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 40 and json.loads((run_dir / "status.json").read_text())["status"] == "done"
    # same data order, gate noise and dropout as the run that was never interrupted
    assert torch.allclose(_log_alpha(checkpoint), _log_alpha(reference_run / "checkpoints/last.ckpt"), atol=1e-6)
    assert metrics["plan"] == json.loads((reference_run / "metrics.json").read_text())["plan"]
    # the CSV log keeps the killed process's rows up to the resume, then goes on to the end, no row twice. The
    # validation row of the checkpoint's step may be missing (it is logged just after the save, so a kill can land
    # between the two, and the resumed run does not validate that step again). After a mid-epoch resume (SIGTERM)
    # Lightning labels later rows one step on, so there only the rows before the resume are compared.
    resumed, uninterrupted = (_csv_rows(d) for d in (run_dir, reference_run))
    signature = lambda r: (r["step"], tuple(sorted(r)))  # noqa: E731
    assert len({signature(r) for r in resumed}) == len(resumed)
    last = 40 if how == signal.SIGKILL else stopped_at - 1  # the last step compared
    ours, expected = ({signature(r): r for r in rows if r["step"] <= last} for rows in (resumed, uninterrupted))
    missing = set(expected) - set(ours)
    assert set(ours) <= set(expected) and len(missing) <= 1, (sorted(set(ours) - set(expected)), missing)
    assert all(step == stopped_at - 1 and "val/loss" in keys for step, keys in missing), missing
    for key, a in ours.items():
        b = expected[key]
        assert all(abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(b[k])) for k in a), (a, b)
    steps = [r["step"] for r in resumed]
    assert steps == sorted(steps) and steps[-1] >= 39 and "val/loss" in resumed[-1]
    # gating began where it was meant to (the equal weights above say so too); the penalty is logged every 5 steps
    first_gated = min(r["step"] for r in resumed if "train/penalty" in r)
    assert start_step <= first_gated <= start_step + 5
    assert metrics["dense"]["step"] <= start_step


def _csv_rows(run_dir: Path) -> list[dict]:
    """metrics.csv as rows of the columns that have a value."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_gated_run_forked_from_a_dense_checkpoint_ends_where_a_run_from_scratch_does(reference_run, tmp_path):
    # the reference (l0_lambda 0.5) left dense.ckpt at step 10; a fork with another lambda trains only the gated
    # steps and must match a run that trained everything with that lambda
    dense = reference_run / "checkpoints" / "dense.ckpt"
    assert _step(dense) == 10
    fork, scratch = tmp_path / "fork", tmp_path / "scratch"
    # the fork is stopped by SIGTERM (as SLURM preempts) and relaunched with the same command: it continues from
    # its own last checkpoint, not from dense.ckpt again
    proc = _start(fork, "pruning.l0_lambda=0.05", f"resume={dense}")
    _wait_for_checkpoint(proc, fork / "checkpoints" / "last.ckpt", min_step=20)
    proc.send_signal(signal.SIGTERM)
    first, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "resumed at step 10" in first, first[-3000:]
    stopped_at = _step(fork / "checkpoints" / "last.ckpt")
    out = _finish(_start(fork, "pruning.l0_lambda=0.05", f"resume={dense}"))
    assert f"continuing from it rather than from {dense}" in out and f"resumed at step {stopped_at}" in out
    _finish(_start(scratch, "pruning.l0_lambda=0.05"))
    assert not (fork / "gates" / "step_0000010.png").exists()  # no dense re-run
    ours, theirs = (json.loads((d / "metrics.json").read_text()) for d in (fork, scratch))
    assert ours["l0_lambda"] == 0.05 and ours["dense"] == theirs["dense"] and ours["dense"]["step"] == 10
    assert ours["plan"] == theirs["plan"] and ours["bleu"] == theirs["bleu"]
    assert torch.equal(_log_alpha(fork / "checkpoints/last.ckpt"), _log_alpha(scratch / "checkpoints/last.ckpt"))
    # and the lambda mattered: the reference's gates went elsewhere
    assert not torch.equal(_log_alpha(fork / "checkpoints/last.ckpt"), _log_alpha(reference_run / "checkpoints/last.ckpt"))


METHOD_OPTIONS = {"l0": [], "l0_budget": ["pruning.target_heads=8"]}


@pytest.fixture(scope="module")
def method_run(tmp_path_factory):
    """``method_run(method)``: the run directory of one smoke run of that method from scratch, each run once per module
    (one test's source run is the other's reference)."""
    from helpers import run_train

    done = {}

    def get(method: str) -> Path:
        if method not in done:
            run = tmp_path_factory.mktemp(method) / "run"
            proc = run_train(run, f"pruning={method}", *METHOD_OPTIONS[method])
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[method] = run
        return done[method]

    return get


@pytest.mark.parametrize("source, target", [("l0", "l0_budget"), ("l0_budget", "l0")])
def test_a_fork_into_another_method_ends_where_that_method_from_scratch_does(tmp_path, method_run, source, target):
    # the other method's optimiser group (a budget's multipliers) starts fresh in the fork, or goes
    from helpers import run_train

    dense = method_run(source) / "checkpoints" / "dense.ckpt"
    # a process of its own with its own string hash seed (the from-scratch runs share the train server's): an
    # order that followed the hashes of names would show here
    proc = run_train(tmp_path / "fork", f"pruning={target}", *METHOD_OPTIONS[target], f"resume={dense}",
                     env={"PYTHONHASHSEED": "random"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fork, scratch = tmp_path / "fork", method_run(target)
    ours, theirs = (json.loads((d / "metrics.json").read_text()) for d in (fork, scratch))
    assert ours["plan"] == theirs["plan"] and ours["val_loss"] == theirs["val_loss"]
    assert torch.equal(_log_alpha(fork / "checkpoints/last.ckpt"), _log_alpha(scratch / "checkpoints/last.ckpt"))


def test_atomic_write_never_leaves_half_a_file(tmp_path, monkeypatch):
    from gatedprune import utils

    target = tmp_path / "metrics.json"
    utils.atomic_write_text(target, "old")
    monkeypatch.setattr(utils.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        utils.atomic_write_text(target, "new and longer")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_resume_from_another_run_dir_and_bad_resume_paths(reference_run, tmp_path):
    env = offline_env()
    bad = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *SMOKE, f"hydra.run.dir={tmp_path / 'x'}", f"resume={tmp_path / 'nope'}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert bad.returncode == 2 and f"error: resume='{tmp_path / 'nope'}': no checkpoint at" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_non_finite_loss_is_skipped_then_stops_the_run(tmp_path, monkeypatch):
    module = gated_module(tmp_path)
    module.log = lambda *args, **kwargs: None  # outside a Trainer
    batch = {"input_ids": torch.randint(3, 90, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "labels": torch.randint(3, 90, (2, 4))}
    assert torch.isfinite(module.training_step(batch, 0))
    monkeypatch.setattr(module, "_cross_entropy", lambda batch, smoothing: torch.tensor(float("nan")))
    assert module.training_step(batch, 1) is None and module.training_step(batch, 2) is None
    assert module.skipped_steps == 2
    with pytest.raises(FloatingPointError, match=r"3 steps in a row had a non-finite loss or gradient \(optim.max_bad_steps=3\)"):
        module.training_step(batch, 3)
    # under DDP the loss goes on to backward (a process that skipped it would hang the others); the gradient
    # check, on gradients averaged across processes, then skips the step in every process
    monkeypatch.setattr("gatedprune.training.module._distributed", lambda: True)
    assert torch.isnan(module.training_step(batch, 4)) and module.skipped_steps == 3


def test_non_finite_gradient_skips_the_optimiser_step(tmp_path):
    module = gated_module(tmp_path)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    next(module.parameters()).grad[0] = float("inf")
    module.on_before_optimizer_step(optimizer)
    optimizer.step()
    assert module.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_log_alpha_is_clamped_after_each_step(tmp_path):
    module = gated_module(tmp_path)
    with torch.no_grad():
        module.gates.gates[0].log_alpha.fill_(1e6)
    module.on_train_batch_end(None, None, 0)
    assert module.gates.gates[0].log_alpha.max().item() == 10.0


def test_bf16_autocast_keeps_gates_and_penalty_in_float32(model_of):
    from gatedprune import attach_gates, attention_sites

    model = model_of("bart").train()
    gates = attach_gates(model, init_log_alpha=0.5)
    try:
        batch = {"input_ids": torch.randint(3, 90, (2, 6)), "labels": torch.randint(3, 90, (2, 4))}
        head_outputs = []  # what the gates multiply: the concatenated heads entering the output projection
        site = attention_sites(model)[0]
        handle = site.projection("o").register_forward_pre_hook(lambda m, args: head_outputs.append(args[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**batch).logits
            penalty = gates.penalty("layer_mean")
        handle.remove()
        assert head_outputs == [torch.bfloat16]  # the model ran in bf16 ...
        assert penalty.dtype == torch.float32  # ... the penalty did not
        (logits.float().square().mean() + penalty).backward()
        for gate in gates.gates:
            assert gate.log_alpha.dtype == torch.float32 and gate.log_alpha.grad.dtype == torch.float32
            assert torch.isfinite(gate.log_alpha.grad).all()
    finally:
        gates.remove()


def test_bf16_mixed_run_keeps_float32_gates(tmp_path):
    from gatedprune.train import train

    cfg = compose_train(tmp_path, "experiment=smoke", "trainer.precision=bf16-mixed", "export.enabled=false")
    metrics = train(cfg)
    assert metrics["steps"] == 30 and metrics["skipped_steps"] == 0
    state = torch.load(tmp_path / metrics["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    assert all(v.dtype == torch.float32 for k, v in state.items() if k.endswith("log_alpha"))
