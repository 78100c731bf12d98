"""A run directory belongs to one process at a time.

Two processes in one directory would write the same checkpoints, delete each other's temporary files and leave
a status that describes neither run. A run therefore holds an exclusive ``flock`` on ``<run dir>/.lock`` from
before it writes anything until it exits. The kernel releases the lock when the process ends, however it ends
(SIGKILL included), so a lock is never stale: the file may stay, the lock does not.

Hydra would write its record of the config (``.hydra/``) before any of our code runs, into a directory another
process may own; ``conf/hydra/default.yaml`` turns that off and the run writes the same three files once it
holds the lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gatedprune.errors import PATH_ERRNOS, unwritable
from gatedprune.utils import write_json

LOCK_FILE = ".lock"


class RunDirBusy(ValueError):
    """Another live process holds the run directory."""


def lock(run_dir: Path) -> int:
    """Take the run directory for this process; returns the lock's file descriptor (kept open until exit).

    ``RunDirBusy`` naming the holder's PID if another process has it.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # read-only, or a dangling symlink: the first write is the lock's
        if err.errno not in PATH_ERRNOS:
            raise
        raise ValueError(unwritable(err)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(
            f"run directory {run_dir} is in use by process {holder}; wait for it to end or choose another "
            "hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    os.set_inheritable(fd, False)  # DDP processes that rank 0 starts must not hold it after rank 0 exits
    return fd


class MadeParents(Callback):
    """Hydra callback (``conf/hydra/default.yaml``): notes the folders above a single run's directory that do not
    exist yet. Hydra makes them (``outputs/<date>/``) before the run starts; a refused run removes them again."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        path = Path(config.hydra.run.dir).absolute().parent
        MADE_PARENTS.clear()
        while not path.exists() and not path.is_symlink():
            MADE_PARENTS.append(path)  # deepest first
            path = path.parent


MADE_PARENTS: list[Path] = []  # what MadeParents found missing above this process's run directory
HYDRA_MADE = {"train.log", LOCK_FILE, ".hydra"}  # what Hydra and the lock put into a directory before a run starts
RUN_MADE = ("status.json", "tokenizer", "csv", "checkpoints", "gates", *HYDRA_MADE)  # what set-up may have written


def is_fresh(run_dir: Path) -> bool:
    """True when ``run_dir`` holds nothing but what Hydra made for this run: bad input may then remove it."""
    return not run_dir.is_dir() or all(entry.name in HYDRA_MADE for entry in run_dir.iterdir())


def remove_fresh(run_dir: Path) -> None:
    """Undo a refused run in a directory it found fresh: remove what it wrote, then the directory if it is empty
    (a directory that held anything else, or was the working directory, keeps it)."""
    for name in RUN_MADE:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    try:
        if run_dir.resolve() != Path.cwd().resolve():
            run_dir.rmdir()
            for parent in MADE_PARENTS:  # made by Hydra for this run, deepest first; only while empty
                if run_dir.absolute().is_relative_to(parent):
                    parent.rmdir()
    except OSError:  # not empty: something else lives there
        pass


def unlock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases the flock


def write_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml``, as Hydra writes them (when Hydra runs us)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    record = run_dir / ".hydra"
    record.mkdir(exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), record / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, record / "overrides.yaml")


def recorded_command(run_dir: Path, groups: tuple[str, ...] | None = None) -> list[str]:
    """The command line that composes ``run_dir``'s config again: its config group choices (``hydra.yaml``: the
    defaults it ran under, which may have changed since, such as the default model) and then its own overrides
    (``overrides.yaml``). ``groups``: only those groups' choices and overrides (``("model",)``: the model it
    trained)."""
    record = run_dir / ".hydra"
    overrides = [str(o) for o in OmegaConf.load(record / "overrides.yaml")] if (record / "overrides.yaml").is_file() \
        else []
    typed = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    choices = []
    if (record / "hydra.yaml").is_file():
        recorded = OmegaConf.load(record / "hydra.yaml").hydra.runtime.choices
        choices = [f"{group}={choice}" for group, choice in recorded.items()
                   if choice is not None and not group.startswith("hydra") and group not in typed]
    if groups is not None:
        def wanted(override: str) -> bool:
            key = override.lstrip("+~").split("=", 1)[0]
            return any(key == g or key.startswith(f"{g}.") for g in groups)

        choices, overrides = [c for c in choices if wanted(c)], [o for o in overrides if wanted(o)]
    return [*choices, *overrides]


def write_status(run_dir: Path, **status) -> None:
    """``status.json``: running, done, interrupted or failed (with the error); strict JSON, written atomically.

    "failed" and "interrupted" are written while the run ends with an error of its own (a full disk, SIGTERM):
    if that write fails too, status.json keeps what it said and the run's own error is the one reported.
    """
    try:
        write_json(run_dir / "status.json", status)
    except OSError as err:
        if status.get("status") not in ("failed", "interrupted"):
            raise
        print(f"could not record status {status['status']!r} ({err}); {run_dir / 'status.json'} is unchanged")
