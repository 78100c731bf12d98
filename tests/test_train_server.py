"""The tests' train server (tests/train_server.py) answers as ``python train.py`` run afresh does: the same exit status,
stdout and stderr for a refusal (train.py reading the overrides), an uncaught error, an exit with a message or a
status, and output on both streams."""

import json
import subprocess
import sys

import pytest

import helpers
from helpers import run_train

# statements run before train.py (run_train's prefix), each ending the run its own way
ENDINGS = {
    "refused": ((), ("pruning.l0_lambda=-0.1",)),
    "uncaught": (("raise RuntimeError('boom from the prefix')",), ()),
    "ctrl-c": (("raise KeyboardInterrupt",), ()),
    "exit message": (("import sys", "sys.exit('stopped: a message')"), ()),
    "exit 3": (("import sys", "print('before', flush=True)", "sys.exit(3)"), ()),
    "exit -1": (("import sys", "sys.exit(-1)"), ()),
    "printed": (("print('to stdout'); import sys; print('to stderr', file=sys.stderr)", "raise SystemExit(0)"), ()),
}


def _both(tmp_path, monkeypatch, prefix, overrides):
    """The same run served and as a fresh process; the served one was served (its args are train.py's)."""
    monkeypatch.delenv("GATEDPRUNE_TEST_SERVER", raising=False)
    served = run_train(tmp_path / "served" / "run", *overrides, prefix=prefix, cwd=tmp_path)
    monkeypatch.setenv("GATEDPRUNE_TEST_SERVER", "0")
    fresh = run_train(tmp_path / "fresh" / "run", *overrides, prefix=prefix, cwd=tmp_path)
    monkeypatch.delenv("GATEDPRUNE_TEST_SERVER")
    assert served.args[0] == str(helpers.ROOT / "train.py") and fresh.args[0] == sys.executable
    return served, fresh


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_served_run_ends_as_a_fresh_process_does(tmp_path, monkeypatch, ending):
    prefix, overrides = ENDINGS[ending]
    served, fresh = _both(tmp_path, monkeypatch, prefix, overrides)
    status = {"refused": 2, "exit 3": 3, "exit -1": 255, "printed": 0, "ctrl-c": -2}.get(ending, 1)  # -2: by SIGINT
    assert served.returncode == fresh.returncode == status
    assert served.stdout == fresh.stdout
    if ending in ("uncaught", "ctrl-c"):  # the same traceback but for the file names of the two ways in
        last = {"uncaught": "RuntimeError: boom from the prefix", "ctrl-c": "KeyboardInterrupt"}[ending]
        assert served.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == last
        assert "Traceback" in served.stderr
    else:
        assert served.stderr == fresh.stderr
    assert not (tmp_path / "served" / "run").exists() and not (tmp_path / "fresh" / "run").exists()


def test_a_served_smoke_run_ends_where_a_fresh_one_does(tmp_path, monkeypatch):
    """A whole smoke run, served and fresh: the same plan, validation loss and BLEU (each an independent run)."""
    served, fresh = _both(tmp_path, monkeypatch, (), ("trainer.max_steps=14",))
    assert served.returncode == fresh.returncode == 0, served.stderr[-2000:] + fresh.stderr[-2000:]
    ours, theirs = (json.loads((tmp_path / way / "run" / "metrics.json").read_text()) for way in ("served", "fresh"))
    assert ours["plan"] == theirs["plan"] and ours["val_loss"] == theirs["val_loss"] and ours["bleu"] == theirs["bleu"]


def test_a_served_run_sees_its_own_directory_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("GATEDPRUNE_TEST_SERVER", raising=False)
    (tmp_path / "here").mkdir()
    monkeypatch.setenv("GATEDPRUNE_CACHE", str(tmp_path / "cache"))
    prefix = ("import os, sys", "print(os.getcwd(), os.environ['GATEDPRUNE_CACHE'])", "sys.exit(0)")
    proc = run_train(tmp_path / "run", prefix=prefix, cwd=tmp_path / "here")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{tmp_path / 'here'} {tmp_path / 'cache'}"


def test_an_environment_read_at_import_starts_a_process_of_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("GATEDPRUNE_TEST_SERVER", raising=False)
    server = helpers._SERVER
    assert server.takes(helpers.offline_env(GATEDPRUNE_CACHE=str(tmp_path)))
    assert not server.takes(helpers.offline_env(HF_MODULES_CACHE=str(tmp_path)))
    assert not server.takes(helpers.offline_env(OMP_NUM_THREADS="2"))
    assert not server.takes(helpers.offline_env(SOMETHING_NEW="1"))  # only what is known to be read when used
    prefix = ("import os, sys", "print(os.environ['HF_HOME'])", "sys.exit(0)")
    proc = run_train(tmp_path / "run", prefix=prefix, env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "hf")
    assert isinstance(proc, subprocess.CompletedProcess) and proc.args[0] != str(helpers.ROOT / "train.py")


def test_a_run_interrupted_while_served_takes_the_server_and_its_run_down(tmp_path, monkeypatch):
    """A test stopped while its run is served (Ctrl-C in pytest): the server and that run are killed, and the next run
    gets a fresh server, not the stale answer."""
    import time
    from pathlib import Path

    monkeypatch.delenv("GATEDPRUNE_TEST_SERVER", raising=False)
    server = helpers._SERVER
    started = run_train(tmp_path / "first", prefix=("import sys", "sys.exit(0)"))  # a server running
    assert started.returncode == 0 and server.process is not None
    stop = tmp_path / "started"
    prefix = ("import pathlib, time", f"pathlib.Path({str(stop)!r}).write_text(str(__import__('os').getpid()))",
              "time.sleep(600)")

    def interrupted():  # the run has started; then the test is interrupted while waiting for its answer
        while not stop.exists():
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(server.process.stdout, "readline", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_train(tmp_path / "run", prefix=prefix)
    assert server.process is None
    status = Path(f"/proc/{stop.read_text()}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "zombie" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    # the sleeping run went with its server: gone, or dead and not yet reaped by whoever inherited it
    assert not status.exists() or "zombie" in status.read_text()
    proc = run_train(tmp_path / "next", prefix=("import sys", "print('fresh server')", "sys.exit(0)"))
    assert proc.returncode == 0 and proc.stdout.strip() == "fresh server"
