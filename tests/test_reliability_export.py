"""Export reads the run directory it is given, and fails in one line: copied runs, bad numbers, a full disk,
an unavailable device, an output directory that is a part of the run (issue 26, items 1, 6, 8 and 9)."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gatedprune.cli import export_command
from gatedprune.shipping import export
from gatedprune.train import train
from helpers import ROOT, compose_train, error_line, offline_env

OLD_RUN = ROOT / "tests" / "data" / "run_0.1.0"  # metrics.json records the absolute path of its training run


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(OLD_RUN, run)
    return run


def _record(run: Path, checkpoint: str) -> None:
    metrics = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**metrics, "checkpoint": checkpoint}))


def _close_gates(checkpoint: Path, modules: int) -> None:
    """The checkpoint's first ``modules`` gated attention modules closed: a model other than the one it held."""
    saved = torch.load(checkpoint, weights_only=True)
    for key in sorted(k for k in saved["state_dict"] if k.endswith("log_alpha"))[:modules]:
        saved["state_dict"][key] = torch.full_like(saved["state_dict"][key], -10.0)
    torch.save(saved, checkpoint)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in err), err
    return errors[0]


# --- item 1: a run directory's own files come first ---------------------------------------------------------------


def test_a_copied_old_run_exports_its_own_checkpoint_not_the_one_its_record_names(tmp_path, caplog):
    # runs written before record the absolute path: `cp -r a b` copies a's path into b's metrics.json
    original, copy = _copy(tmp_path, "a"), _copy(tmp_path, "a_backup")
    _record(original, str(original / "checkpoints" / "last.ckpt"))
    _record(copy, str(original / "checkpoints" / "last.ckpt"))
    _close_gates(original / "checkpoints" / "last.ckpt", 3)  # `a` trained again: another model (12 of 24 heads)
    own = copy / "checkpoints" / "last.ckpt"

    caplog.set_level("INFO", logger="gatedprune.export")
    assert export_command([str(copy), str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / export.REPORT_FILE).read_text())
    assert report["heads_kept"]["total"] == [24, 24]  # the copy's model keeps every head
    assert report["checkpoint"] == {"path": str(own.resolve()), "sha256": _sha256(own)}
    assert f"read checkpoint {own}" in caplog.text  # the export says which checkpoint it read


def test_a_copied_run_exports_the_copy_after_the_original_trains_again(tmp_path):
    runs = tmp_path / "runs"
    metrics = train(compose_train(runs / "a", "experiment=smoke", "export.enabled=false"))
    # recorded relative to the run directory, so that a copy names its own file
    assert metrics["checkpoint"] == "checkpoints/last.ckpt"
    assert json.loads((runs / "a" / "metrics.json").read_text())["checkpoint"] == "checkpoints/last.ckpt"
    shutil.copytree(runs / "a", runs / "a_backup")
    _close_gates(runs / "a" / "checkpoints" / "last.ckpt", 6)  # every gate of `a` closed: no head left

    assert export_command([str(runs / "a_backup"), str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / export.REPORT_FILE).read_text())
    assert report["heads_kept"]["total"][0] == metrics["heads_alive"]["total"] > 0
    assert report["checkpoint"]["sha256"] == _sha256(runs / "a_backup" / "checkpoints" / "last.ckpt")


def test_metrics_json_names_a_checkpoint_inside_the_run_relative_to_it(tmp_path):
    from gatedprune.reports.metrics import checkpoint_record

    run = tmp_path / "run"
    assert checkpoint_record(run / "checkpoints" / "last.ckpt", run) == "checkpoints/last.ckpt"
    # another run's file (the model a baseline pruned) stays absolute; a baseline of a pretrained model has none
    assert checkpoint_record(tmp_path / "dense" / "last.ckpt", run) == str((tmp_path / "dense" / "last.ckpt").resolve())
    assert checkpoint_record(None, run) is None


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_copy_whose_own_checkpoint_is_missing_or_unreadable_is_refused(tmp_path, capsys, damage):
    original, copy = _copy(tmp_path, "a"), _copy(tmp_path, "a_backup")
    _record(copy, str(original / "checkpoints" / "last.ckpt"))  # a file that loads, in another run
    own = copy / "checkpoints" / "last.ckpt"
    if damage == "missing":
        own.unlink()
    else:
        own.write_bytes(own.read_bytes()[:1000])

    assert export_command([str(copy), str(tmp_path / "out")]) == 2
    line = _one_error(capsys)
    assert str(copy) in line and (("no checkpoint of its own" in line and "never read" in line) if damage == "missing"
                                  else "not a readable checkpoint" in line), line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_relative_record_that_leaves_the_run_is_not_followed(tmp_path, capsys):
    other, run = _copy(tmp_path, "other"), _copy(tmp_path, "run")
    _close_gates(other / "checkpoints" / "last.ckpt", 3)
    _record(run, "../other/checkpoints/last.ckpt")
    assert export_command([str(run), str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / export.REPORT_FILE).read_text())
    assert report["checkpoint"]["sha256"] == _sha256(run / "checkpoints" / "last.ckpt")
    assert report["heads_kept"]["total"] == [24, 24]


# --- item 6: numbers that would do nothing -----------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [("--samples", "-1"), ("--samples", "0"), ("--max-new-tokens", "0"),
                                           ("--max-new-tokens", "-3")])
def test_export_numbers_below_one_are_refused(tmp_path, capsys, option, value):
    run = _copy(tmp_path, "run")
    assert export_command([str(run), str(tmp_path / "out"), option, value]) == 2
    assert _one_error(capsys) == f"error: {option}={value} is below 1; allowed: a whole number >= 1"
    assert not (tmp_path / "out").exists()


# --- item 8: one line where a traceback was ----------------------------------------------------------------------


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(tmp_path):
    run = _copy(tmp_path, "run")
    # the weights' write fails as a full disk makes it fail: ENOSPC, naming the file
    prefix = ("import errno, transformers.modeling_utils as mu; "
              "mu.safe_save_file = lambda tensors, filename, **kw: (_ for _ in ()).throw("
              "OSError(errno.ENOSPC, 'No space left on device', filename))")
    script = f"{prefix}; import sys; from gatedprune.cli import export_command; sys.exit(export_command(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", script, str(run), str(tmp_path / "out")], capture_output=True,
                          text=True, env=offline_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith(f"error: no space left on device writing {tmp_path / 'out'}"), line
    assert "Exception" not in proc.stderr and "Writing model shards" not in proc.stderr  # no progress bar either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out/, no hidden .out.partial-PID


def test_no_space_in_any_write_of_the_directory_is_the_same_line(tmp_path, monkeypatch, capsys):
    run = _copy(tmp_path, "run")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export.export_dir, "write_card", full)  # the last write: model card and report
    assert export_command([str(run), str(tmp_path / "out")]) == 1
    assert _one_error(capsys).startswith(f"error: no space left on device writing {tmp_path / 'out'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("device, cuda, says", [
    ("cuda", 0, "error: --device cuda is not available here (no CUDA device); allowed: cpu"),
    ("cuda:3", 2, "error: --device cuda:3 is not available here (2 CUDA devices); allowed: cpu, cuda, cuda:0, cuda:1"),
    ("gpu", 0, "error: --device gpu is not a device; allowed: cpu"),
    ("mps", 0, "error: --device mps is not available here; allowed: cpu"),
])
def test_an_unavailable_or_unknown_device_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys, device,
                                                                           cuda, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)  # a fake CUDA: this test needs no GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def never(*args):
        raise AssertionError("the checkpoint was loaded before the device was checked")

    monkeypatch.setattr(export, "load_gated_checkpoint", never)
    run = _copy(tmp_path, "run")
    assert export_command([str(run), str(tmp_path / "out"), "--device", device]) == 2
    assert _one_error(capsys) == says
    assert not (tmp_path / "out").exists()


# --- item 9: an export never replaces a part of its source run -------------------------------------------------------


@pytest.mark.parametrize("part", ["tokenizer", "pruned", "empty"])  # checkpoints/: test_hostile_input
def test_an_existing_folder_inside_the_run_is_refused_even_with_overwrite(tmp_path, capsys, part):
    run = _copy(tmp_path, "run")
    (run / "empty").mkdir()
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert export_command([str(run), str(run / part), "--overwrite"]) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: output directory {run / part} ") and "part of the source run" in line, line
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_new_folder_inside_the_run_is_allowed(tmp_path):
    run = _copy(tmp_path, "run")
    assert export_command([str(run), str(run / "top12"), "--top-k", "12"]) == 0
    assert json.loads((run / "top12" / export.REPORT_FILE).read_text())["heads_kept"]["total"] == [12, 24]
