"""How every gatedprune command ends when something goes wrong: one line on stderr, ``error: ...``, and an exit code.

- exit 2: bad input (a value, path or file that cannot work), refused before anything is written;
- exit 1: good input, but the run could not produce a valid result (it diverged, or the pruned model did not
  verify).

``GATEDPRUNE_DEBUG=1`` shows the traceback instead. Hydra's own errors (a mistyped key, an unknown option) are
folded into one line as well.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class RunFailed(RuntimeError):
    """The input was fine, but the result is not valid (the message carries the numbers)."""


class NoSpaceLeft(OSError):
    """A write that found the disk full (ENOSPC), naming the file it was writing: the target, not the temporary
    file beside it that a failed write leaves nothing of (``utils.atomic_write_with``)."""

    def __str__(self) -> str:
        return f"no space left on device writing {self.filename}"


class SweepMemberFailed(RunFailed):
    """A member of a ``-m`` sweep failed; the message names it: ``NUM (OVERRIDES: error)``."""


class _Sweep:
    """This process's ``-m`` sweep: members run, the failures they reported, and the errors that left a member
    unreported (a bug, or GATEDPRUNE_DEBUG: their tracebacks show)."""

    ran = 0
    failed: list[str] = []
    codes: list[int] = []  # each failure's exit code: the sweep's is 2 only if every member was refused as bad input
    unreported: list[BaseException] = []


BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
RUN_FAILURES = (RunFailed, FloatingPointError)  # FloatingPointError: a run that diverged (optim.max_bad_steps)


def one_line(text: str) -> str:
    """The lines of a message joined by "; ", or by a space after a colon (Hydra's config search path: left out)."""
    lines = [" ".join(line.split()) for line in text.split("Config search path")[0].splitlines() if line.strip()]
    return "".join(line + ("" if i == len(lines) - 1 else " " if line.endswith(":") else "; ") for i, line in enumerate(lines))


def fail(message: str, code: int = 2) -> int:
    """Print ``error: message`` (one line) on stderr; returns ``code`` for the caller to exit with."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    return code


def exit_code(err: BaseException) -> int | None:
    """2 for bad input, 1 for a failed run, None for anything else (a bug: its traceback should show)."""
    if os.environ.get("GATEDPRUNE_DEBUG"):
        return None
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, (*BAD_INPUT, OmegaConfBaseException)):  # OmegaConf: a mandatory value left unset, say
        return 2
    if isinstance(err, RUN_FAILURES):
        return 1
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:  # a full disk: good input, the run could not end well
        return 1
    return None


def run_reported(function: Callable[[], object]) -> int:
    """Call ``function``; 0 if it returns, else the error reported in one line and its exit code."""
    try:
        function()
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        return fail(str(err), code)
    return 0


@contextmanager
def reported_errors() -> Iterator[None]:
    """Exit with ``error: ...`` and 2 or 1 for bad input and failed runs raised inside.

    In a member of a ``-m`` sweep it does not exit: SystemExit would pass Hydra's per-job handling and end the
    sweep there. The failure is logged (the member's train.log), recorded for the sweep's one line at the end
    (``run_hydra_app``) and raised as ``SweepMemberFailed`` where the sweeper must see it (``_sweep_member``).
    """
    member = _sweep_member()
    try:
        yield
    except Exception as err:
        code = exit_code(err)
        if code is None:
            _Sweep.unreported.append(err)
            raise
        if member is None:
            sys.exit(fail(str(err), code))
        name, raise_it = member
        failure = f"{name}{one_line(str(err))})"
        _Sweep.failed.append(failure)
        _Sweep.codes.append(code)
        logging.getLogger(__name__).error(f"sweep member {failure} failed")
        if raise_it:
            raise SweepMemberFailed(failure) from err


def in_sweep() -> bool:
    """True inside a member of a ``-m`` sweep (Hydra's MULTIRUN mode)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _sweep_member() -> tuple[str, bool] | None:
    """``(name, raise_it)`` of the ``-m`` sweep member running now, None outside one. The name is the job number
    and the overrides not on the command line as given (the swept values, an Optuna trial's), e.g.
    ``1 (optim.lr=0.5: `` (the error follows).

    ``raise_it``: Hydra's basic sweeper re-raises a failed job's error after its batch, skipping later batches and
    printing a line of its own, so under it and the basic launcher the failure is only recorded. Another sweeper
    (Optuna counts failed trials against max_failure_rate) or launcher (SLURM: the member runs in another
    process) must see the job fail, so it is raised.
    """
    from hydra.core.hydra_config import HydraConfig

    if not in_sweep():
        return None
    hydra_cfg = HydraConfig.get()
    _Sweep.ran += 1
    swept = " ".join(o for o in hydra_cfg.overrides.task if o not in sys.argv[1:])
    local = (str(hydra_cfg.sweeper.get("_target_")).endswith(".BasicSweeper")
             and str(hydra_cfg.launcher.get("_target_")).endswith(".BasicLauncher"))
    return f"{hydra_cfg.job.num} ({swept + ': ' if swept else ''}", not local


def unwritable(err: OSError) -> str:
    """The one-line message of a path the run cannot make or write (read-only, a dangling symlink)."""
    path = err.filename
    if path is not None and os.path.islink(path) and not os.path.exists(path):
        return (f"run directory {path} is a symlink to {os.readlink(path)}, which does not exist; allowed: a "
                f"directory, or a path where one can be made {_RUN_DIR_KEYS}")
    return f"cannot write {path}: {err.strerror or err}; allowed: a run directory this process can write {_RUN_DIR_KEYS}"


_RUN_DIR_KEYS = "(hydra.run.dir; hydra.sweep.dir with -m)"


# what making or writing a path the user named can fail with (not a full disk: the run's own errors say that)
PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.ENOTDIR, errno.ELOOP, errno.ENOENT}


def _path_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err`` (logging wraps a log file it cannot open in a ValueError) if it is about a
    path, and ``err`` did not come out of a run (a member's failure, or a bug)."""
    while err is not None and not isinstance(err, OSError):
        if isinstance(err, SweepMemberFailed) or any(err is e for e in _Sweep.unreported):
            return None
        err = err.__cause__ or err.__context__
    if any(err is e for e in _Sweep.unreported):
        return None
    return err if err is not None and err.filename is not None and err.errno in PATH_ERRNOS else None


def run_hydra_app(app: Callable[[], object]) -> None:
    """Run a ``@hydra.main`` function; a config Hydra cannot compose is bad input like any other.

    Hydra prints such errors over several lines and exits 1; with ``HYDRA_FULL_ERROR`` it raises them instead,
    and they are reported here in one line. So is a run directory Hydra cannot make or write. A ``-m`` sweep whose
    members failed (``reported_errors``) ends with one line naming them, exit 1.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    _Sweep.ran, _Sweep.failed, _Sweep.codes, _Sweep.unreported = 0, [], [], []  # this call's sweep alone
    try:
        app()
    except (HydraException, OmegaConfBaseException) as err:
        if os.environ.get("GATEDPRUNE_DEBUG"):
            raise
        first, *advice = one_line(str(err)).split("; ")
        cause = f": {one_line(str(err.__cause__)).split('; ')[0]}" if err.__cause__ is not None else ""
        sys.exit(fail(first.rstrip(".") + cause + (f" ({'; '.join(advice)})" if advice else ""), 2))
    except Exception as err:
        if os.environ.get("GATEDPRUNE_DEBUG"):
            raise
        # Hydra makes the run directory and its log file before the run starts: a path it cannot make or write
        path_error = _path_error(err)
        if path_error is not None:
            sys.exit(fail(unwritable(path_error), 2))
        # a sweeper that stops at a failed member (Optuna past its max_failure_rate, or with no trial left to
        # pick the best of) raises again; a member run in another process (a SLURM launcher) is known by its error
        if any(err is e for e in _Sweep.unreported) or not (isinstance(err, SweepMemberFailed) or _Sweep.failed):
            raise
        if not _Sweep.failed:
            _Sweep.failed.append(str(err))
    if _Sweep.failed:
        failed = len(_Sweep.failed)
        counted = f"{failed} of {_Sweep.ran} sweep members" if _Sweep.ran >= failed else "a sweep member"
        bad_input = len(_Sweep.codes) == failed and all(code == 2 for code in _Sweep.codes)
        sys.exit(fail(f"{counted} failed: " + "; ".join(_Sweep.failed), 2 if bad_input else 1))
