"""Sweeps that survive a failing member, and train's one-line errors about its run directory (issue 26, items 2,
8 and 9).

Faults are injected (a module ``inject.py`` imported before train.py runs, see ``_inject``) rather than set up:
tests run as root, which ignores file permissions, so a read-only directory is an injected PermissionError or
``EROFS`` at the first write, never a chmod.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, error_line, offline_env, run_train

from gatedprune.reports.sweep import summarise


def _inject(tmp_path: Path, code: str) -> tuple[str, ...]:
    """``run_train``'s prefix importing ``code`` (written to ``tmp_path/inject.py``) before train.py runs."""
    (tmp_path / "inject.py").write_text(textwrap.dedent(code))
    return (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import inject",)


# _setup (the run's set-up, inside train()'s status handling) raising what the named seed's member is given
SETUP_RAISES = """
    import gatedprune.train as train
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    RAISES = {RAISES}

    def _setup(cfg, run_dir):
        raise RAISES[cfg.seed]

    train._setup = _setup
"""


def _setup_raises(tmp_path: Path, raises: str) -> tuple[str, ...]:
    return _inject(tmp_path, SETUP_RAISES.replace("{RAISES}", raises))


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


# ---- item 2: a -m sweep goes on past a failing member


def test_a_diverging_member_fails_alone_and_the_sweep_goes_on_to_exit_1_naming_it(tmp_path):
    sweep = tmp_path / "multirun"
    proc = run_train(tmp_path / "unused", "optim.lr=1e12,0.0005", f"hydra.sweep.dir={sweep}", flags=("-m",))
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    # the member is named by its overrides as Hydra's sweep wrote them (1e12 as 1000000000000.0)
    assert line.startswith("error: 1 of 2 sweep members failed: 0 (optim.lr=1000000000000.0: 10 steps in a row "
                           "had a non-finite loss or gradient"), line
    assert "Error executing job" not in proc.stderr
    failed = _status(sweep / "0")
    assert failed["status"] == "failed" and failed["error"].startswith("FloatingPointError: 10 steps"), failed
    assert _status(sweep / "1")["status"] == "done" and (sweep / "1" / "metrics.json").is_file()
    rows = {row["run"]: row for row in summarise(sweep)}
    assert rows["0"]["status"] == "failed" and "10 steps in a row" in rows["0"]["error"]
    assert rows["1"]["status"] == "done" and rows["1"]["bleu"] is not None


def test_every_failed_member_is_named_and_a_refused_member_keeps_its_directory_and_status(tmp_path):
    sweep = tmp_path / "multirun"
    prefix = _setup_raises(tmp_path, "{1: ValueError('pruning.l0_lambda=-1 is negative; allowed: a number >= 0'), "
                                     "2: FloatingPointError('diverged')}")
    proc = run_train(tmp_path / "unused", "seed=1,2", f"hydra.sweep.dir={sweep}", flags=("-m",), prefix=prefix)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_line(proc) == ("error: 2 of 2 sweep members failed: 0 (seed=1: pruning.l0_lambda=-1 is negative; "
                                "allowed: a number >= 0); 1 (seed=2: diverged)")
    # a sweep member refused for bad input keeps its directory (a single run's is removed): the summary lists it
    assert _status(sweep / "0") == {"status": "failed",
                                    "error": "ValueError: pruning.l0_lambda=-1 is negative; allowed: a number >= 0"}
    assert _status(sweep / "1") == {"status": "failed", "error": "FloatingPointError: diverged"}
    assert [row["status"] for row in summarise(sweep)] == ["failed", "failed"]


def test_sigterm_in_a_member_stops_the_whole_sweep_with_143(tmp_path):
    sweep = tmp_path / "multirun"
    prefix = _setup_raises(tmp_path, "{1: SIGTERMException(), 2: SIGTERMException()}")
    proc = run_train(tmp_path / "unused", "seed=1,2", f"hydra.sweep.dir={sweep}", flags=("-m",), prefix=prefix)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert _status(sweep / "0")["status"] == "interrupted"
    assert not (sweep / "1").exists()


def test_ctrl_c_in_a_member_stops_the_whole_sweep(tmp_path):
    sweep = tmp_path / "multirun"
    prefix = _setup_raises(tmp_path, "{1: KeyboardInterrupt(), 2: KeyboardInterrupt()}")
    proc = run_train(tmp_path / "unused", "seed=1,2", f"hydra.sweep.dir={sweep}", flags=("-m",), prefix=prefix)
    assert proc.returncode in (-2, 130), proc.stderr[-3000:]  # Python ends itself with SIGINT after Ctrl-C
    assert "KeyboardInterrupt" in _status(sweep / "0")["error"]
    assert not (sweep / "1").exists()


def test_a_single_run_keeps_its_one_line_and_exit_codes(tmp_path):
    prefix = _setup_raises(tmp_path, "{0: FloatingPointError('diverged'), 1: ValueError('seed=1 is bad')}")
    failed = run_train(tmp_path / "failed", "seed=0", prefix=prefix)
    assert failed.returncode == 1 and error_line(failed) == "error: diverged", failed.stderr[-3000:]
    assert "Error executing job" not in failed.stderr
    refused = run_train(tmp_path / "refused", "seed=1", prefix=prefix)
    assert refused.returncode == 2 and error_line(refused) == "error: seed=1 is bad", refused.stderr[-3000:]
    assert not (tmp_path / "refused").exists()


def test_optuna_stops_at_a_failed_trial_unless_max_failure_rate_lets_it_go_on(tmp_path):
    prefix = _setup_raises(tmp_path, "{0: FloatingPointError('diverged')}")
    args = ("hparams_search=optuna", "hydra.sweeper.n_trials=2", "seed=0")
    stopped = run_train(tmp_path / "unused", *args, f"hydra.sweep.dir={tmp_path / 'stopped'}", flags=("-m",),
                        prefix=prefix)
    # max_failure_rate 0 (Optuna's default): the first failed trial stops the study
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert error_line(stopped).startswith("error: 1 of 1 sweep members failed: 0 (pruning.l0_lambda="), stopped.stderr
    assert error_line(stopped).endswith(": diverged)")
    assert not (tmp_path / "stopped" / "1").exists()
    went_on = run_train(tmp_path / "unused", *args, "hydra.sweeper.max_failure_rate=1.0",
                        f"hydra.sweep.dir={tmp_path / 'went_on'}", flags=("-m",), prefix=prefix)
    assert went_on.returncode == 1, went_on.stderr[-3000:]
    assert error_line(went_on).startswith("error: 2 of 2 sweep members failed: 0 (pruning.l0_lambda=")
    assert [_status(tmp_path / "went_on" / n)["status"] for n in "01"] == ["failed", "failed"]


# ---- item 8: run directories that cannot be written


@pytest.mark.parametrize("first_write", ["hydra_log", "lock"])
def test_a_read_only_run_directory_is_one_line_exit_2(tmp_path, first_write):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    prefix = _inject(tmp_path, f"""
        import builtins, errno, logging, os

        def refusing(real):  # a read-only mount: every file made in the run directory is refused
            def refuse(path, *args, **kwargs):
                if str(path).startswith({str(run_dir)!r}):
                    raise OSError(errno.EROFS, "Read-only file system", str(path))
                return real(path, *args, **kwargs)
            return refuse

        os.open = refusing(os.open)  # the run's lock
        logging.open = refusing(builtins.open)  # Hydra's train.log (logging.FileHandler opens files with open)
    """)
    # Hydra opens train.log before the run starts; without Hydra's log file the run's lock is the first write
    logging = () if first_write == "hydra_log" else ("hydra/job_logging=none",)
    proc = run_train(run_dir, *logging, prefix=prefix)
    assert proc.returncode == 2, proc.stderr[-3000:]
    written = "train.log" if first_write == "hydra_log" else ".lock"
    assert error_line(proc) == (f"error: cannot write {run_dir / written}: Read-only file system; allowed: a run "
                                "directory this process can write (hydra.run.dir; hydra.sweep.dir with -m)")


def test_a_run_directory_hydra_cannot_make_is_one_line_exit_2(tmp_path):
    parent = tmp_path / "ro"
    prefix = _inject(tmp_path, f"""
        import errno, pathlib
        _mkdir = pathlib.Path.mkdir

        def refusing_mkdir(self, *args, **kwargs):  # a read-only parent: Hydra cannot make the run directory
            if str(self).startswith({str(parent)!r}):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return _mkdir(self, *args, **kwargs)

        pathlib.Path.mkdir = refusing_mkdir
    """)
    proc = run_train(parent / "run", prefix=prefix, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc) == (f"error: cannot write {parent / 'run'}: Permission denied; allowed: a run directory "
                                "this process can write (hydra.run.dir; hydra.sweep.dir with -m)")


def test_a_dangling_symlink_as_run_directory_is_one_line_exit_2(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "run")
    proc = run_train(link)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc) == (f"error: run directory {link} is a symlink to {tmp_path / 'nowhere' / 'run'}, which "
                                "does not exist; allowed: a directory, or a path where one can be made "
                                "(hydra.run.dir; hydra.sweep.dir with -m)")
    assert not (tmp_path / "nowhere").exists()


# ---- item 9: a refused run leaves nothing; python -m gatedprune's usage is an error line


def _train_in(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """train.py run in ``cwd`` with the default run directory, outputs/<date>/<time>."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "experiment=smoke", *overrides],
                          capture_output=True, text=True, env=offline_env(), cwd=cwd, timeout=300)


def test_a_refused_run_in_an_empty_folder_leaves_nothing_there(tmp_path):
    proc = _train_in(tmp_path, "pruning.l0_lambda=-0.1")
    assert proc.returncode == 2 and "pruning.l0_lambda=-0.1" in error_line(proc), proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_refused_run_keeps_the_folders_it_did_not_make(tmp_path):
    (tmp_path / "outputs").mkdir()  # there before the run, empty: kept
    proc = _train_in(tmp_path, "pruning.l0_lambda=-0.1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [tmp_path / "outputs"] and list((tmp_path / "outputs").iterdir()) == []


def test_python_m_gatedprune_with_an_unknown_command_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "frobnicate"], capture_output=True, text=True,
                          env=offline_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert error_line(proc).startswith("error: unknown command frobnicate; usage: python -m gatedprune {train,finetune,export,")
    assert proc.stderr.count("\n") == 1
