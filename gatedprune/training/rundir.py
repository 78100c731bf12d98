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

from omegaconf import DictConfig, OmegaConf

from gatedprune.utils import write_json

LOCK_FILE = ".lock"


class RunDirBusy(ValueError):
    """Another live process holds the run directory."""


def lock(run_dir: Path) -> int:
    """Take the run directory for this process; returns the lock's file descriptor (kept open until exit).

    ``RunDirBusy`` naming the holder's PID if another process has it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
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


def write_status(run_dir: Path, **status) -> None:
    """``status.json``: running, done, interrupted or failed (with the error); strict JSON, written atomically."""
    write_json(run_dir / "status.json", status)
