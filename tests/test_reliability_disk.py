"""A full disk: checkpoints and result files are written beside their target and renamed into place, so a failed
write leaves the previous file whole; the run ends in one line, and a relaunch rewrites a dense.ckpt that does
not load. The disk is never filled: the ENOSPC error is injected into the write."""

import errno
import json
import os
import shutil
import tempfile

import pytest
import torch

from helpers import error_line, run_train

FAST = ["export.enabled=false"]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")

# run before train.py: the save of a checkpoint of step STEP (the NTH one) writes part of the file, then finds the
# disk full; where the bytes were going is printed, so the test can tell where the file was staged
_FULL_DISK = """
import errno, os, torch
_save, _calls = torch.save, []
def _save_until_full(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("global_step") == {step}:
        _calls.append(1)
        if len(_calls) == {nth}:
            where = os.readlink(f"/proc/self/fd/{{f.fileno()}}") if hasattr(f, "fileno") else type(f).__name__
            print("staged in", where, flush=True)
            f.write(b"PK" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
    return _save(obj, f, *args, **kwargs)
torch.save = _save_until_full
"""


def _full_disk(step: int, nth: int) -> list[str]:
    return [f"exec({_FULL_DISK.format(step=step, nth=nth)!r})"]


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _same(a, b) -> bool:
    """Equal tensors (and plain data around them), through dicts and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


# last.ckpt is saved every 10 steps; at step 10 dense.ckpt follows it, after that step's validation
@pytest.mark.parametrize("name, step, nth, previous_step", [("last.ckpt", 20, 1, 10), ("dense.ckpt", 10, 2, None)])
def test_disk_full_during_a_checkpoint_save_is_one_line_and_keeps_the_previous_file(tmp_path, name, step, nth,
                                                                                     previous_step):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    proc = run_train(run_dir, *FAST, prefix=_full_disk(step, nth))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_line(proc) == f"error: no space left on device writing {checkpoints / name}"
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {"status": "failed", "error": f"NoSpaceLeft: no space left on device writing {checkpoints / name}"}
    # staged beside the target (never in $TMPDIR, which may be another file system), and cleaned up
    assert f"staged in {checkpoints}/.{name}." in proc.stdout, proc.stdout[-2000:]
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
    if previous_step is None:
        assert not (checkpoints / name).exists()
    else:
        assert _load(checkpoints / name)["global_step"] == previous_step  # the previous file, whole
    assert _load(checkpoints / "last.ckpt")["global_step"] == 10


def test_checkpoint_io_replaces_the_target_only_when_the_new_file_is_whole(tmp_path, monkeypatch):
    from gatedprune.training.checkpoint_io import AtomicCheckpointIO

    elsewhere = tmp_path / "tmp"  # $TMPDIR: nothing may be staged there
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    io, target = AtomicCheckpointIO(), tmp_path / "run" / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, target)
    assert _load(target)["global_step"] == 1
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, target)
    assert _load(target)["global_step"] == 2 and synced  # flushed to the disk before the rename

    def full(obj, f, *args, **kwargs):
        f.write(b"PK" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as raised:
        io.save_checkpoint({"global_step": 3}, target)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert _load(target)["global_step"] == 2
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"] and not list(elsewhere.iterdir())


def test_no_space_left_is_one_line_naming_the_file_and_exit_1(tmp_path, monkeypatch, capsys):
    from gatedprune import utils
    from gatedprune.errors import run_reported

    target = tmp_path / "metrics.json"
    utils.write_json(target, {"old": 1})
    monkeypatch.setattr(utils.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    assert run_reported(lambda: utils.write_json(target, {"new": 2})) == 1
    assert capsys.readouterr().err == f"error: no space left on device writing {target}\n"
    assert json.loads(target.read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_other_os_errors_keep_their_behaviour():
    from gatedprune.errors import exit_code

    assert exit_code(OSError(errno.EACCES, "Permission denied", "x")) is None
    assert exit_code(FileNotFoundError(errno.ENOENT, "No such file", "x")) == 2
    assert exit_code(OSError(errno.ENOSPC, "No space left on device", "x")) == 1


def test_a_failed_status_on_a_full_disk_does_not_raise_again(tmp_path, monkeypatch):
    from gatedprune import utils
    from gatedprune.training import rundir

    rundir.write_status(tmp_path, status="running")
    monkeypatch.setattr(utils.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    rundir.write_status(tmp_path, status="failed", error="OSError: no space")  # the run's own error goes on
    assert json.loads((tmp_path / "status.json").read_text()) == {"status": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]
    with pytest.raises(OSError):  # any other status is the run's own write: it fails the run
        rundir.write_status(tmp_path, status="done")


def test_sweep_summaries_are_renamed_into_place(tmp_path, monkeypatch):
    from gatedprune import utils
    from gatedprune.reports import sweep

    member = tmp_path / "multirun" / "0"
    member.mkdir(parents=True)
    utils.write_json(member / "status.json", {"status": "failed", "error": "ValueError: x"})
    rows = sweep.summarise(tmp_path / "multirun", tmp_path / "out")
    names = ["pareto.png", "summary.csv", "summary.md"]
    before = {name: (tmp_path / "out" / name).read_bytes() for name in names}
    monkeypatch.setattr(utils.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OSError) as raised:
        sweep.summarise(tmp_path / "multirun", tmp_path / "out")
    assert raised.value.filename == str(tmp_path / "out" / "summary.csv")
    with pytest.raises(OSError) as raised:
        sweep.plot_pareto(rows, tmp_path / "out" / "pareto.png")
    assert raised.value.filename == str(tmp_path / "out" / "pareto.png")
    assert {name: (tmp_path / "out" / name).read_bytes() for name in names} == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names


def test_relaunch_rewrites_a_dense_checkpoint_that_does_not_load(tmp_path):
    run_dir = tmp_path / "run"
    dense = run_dir / "checkpoints" / "dense.ckpt"
    first = run_train(run_dir, *FAST)
    assert first.returncode == 0, first.stderr[-3000:]
    original = _load(dense)["state_dict"]
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")
    with open(dense, "r+b") as f:  # as a copy onto a full disk left it
        f.truncate(dense.stat().st_size // 2)

    again = run_train(run_dir, *FAST)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "dense.ckpt does not load" in again.stdout, again.stdout[-3000:]
    # nothing deleted: the broken file and the last checkpoint past it are set aside
    assert (run_dir / "checkpoints" / "dense.ckpt.broken").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt.broken").is_file()
    rewritten = _load(dense)
    assert rewritten["global_step"] == 10
    assert _same(original, rewritten["state_dict"])
    # the run trained again from the start: it ends where it ended before
    ours, before = _load(run_dir / "checkpoints" / "last.ckpt"), _load(tmp_path / "last.ckpt")
    assert ours["global_step"] == before["global_step"]
    assert _same(before["state_dict"], ours["state_dict"])
    assert json.loads((run_dir / "status.json").read_text())["status"] == "done"

    fork = run_train(tmp_path / "fork", *FAST, "trainer.max_steps=20", f"resume={dense}")
    assert fork.returncode == 0, fork.stderr[-3000:]


def test_a_dense_checkpoint_broken_again_after_a_retrain_is_refused_not_retrained_forever(tmp_path):
    from gatedprune.training.checkpoints import resume_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "dense.ckpt").write_bytes(b"cut short")
    (checkpoints / "last.ckpt").write_bytes(b"a later step")
    (checkpoints / "dense.ckpt.broken").write_bytes(b"set aside by the previous relaunch")
    with pytest.raises(ValueError, match="neither did the one set aside as .*dense.ckpt.broken"):
        resume_checkpoint("auto", tmp_path / "run")
    assert (checkpoints / "last.ckpt").read_bytes() == b"a later step"  # nothing moved


def test_a_dense_checkpoint_that_cannot_be_read_is_not_taken_for_broken(tmp_path, monkeypatch):
    from gatedprune.training.checkpoints import resume_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "dense.ckpt").write_bytes(b"whatever")
    (checkpoints / "last.ckpt").write_bytes(b"progress")

    def unreadable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(checkpoints / "dense.ckpt"))

    monkeypatch.setattr(torch, "load", unreadable)
    with pytest.raises(PermissionError):
        resume_checkpoint("auto", tmp_path / "run")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["dense.ckpt", "last.ckpt"]  # a read error moves nothing
