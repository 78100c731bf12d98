"""A CSV logger whose resumed run keeps the rows it logged before it stopped.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when its directory exists, so a run continued in its own
directory (``resume=auto``) would keep only the steps after the resume. With ``resuming`` set (train.py sets it for
such a run) this one keeps the old rows up to the first step the new process logs: a run killed at step 37 and
resumed from its checkpoint at step 30 logs steps 30-37 again (same data order), and those rows replace the killed
process's ones. Two seams remain, both Lightning's: the validation row of the checkpoint's step is missing if the
kill came between the checkpoint and that row, and after a mid-epoch resume (SIGTERM) later rows are labelled one
step on. Without ``resuming`` (a fresh run, a fork into a new directory) an old file is replaced, as Lightning does.
"""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _KeepingWriter(ExperimentWriter):
    def __init__(self, log_dir: str, keep: bool):
        self.keep, self.earlier = keep, None  # earlier: the old file's rows, merged at this process's first save
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:  # called by __init__, where Lightning's deletes the old file
        if self._fs.isfile(self.metrics_file_path):
            if not self.keep:
                self._fs.rm_file(self.metrics_file_path)
                return
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.earlier = list(csv.DictReader(file))

    def save(self) -> None:
        if self.metrics and self.earlier is not None:  # the first save of this process: merge, then append as usual
            first = min(row["step"] for row in self.metrics)
            kept = [row for row in self.earlier if (step := _step(row)) is not None and step < first]
            self.earlier = None
            keys = sorted({key for row in kept for key, value in row.items() if value not in ("", None)})
            # written beside and moved into place: a kill during the rewrite leaves the old file whole
            partial = self.metrics_file_path + ".partial"
            with self._fs.open(partial, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=keys, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(kept)
            self._fs.mv(partial, self.metrics_file_path)
            self.metrics_keys = keys  # Lightning's save adds this process's new keys and rewrites the header
        super().save()


def _step(row: dict) -> int | None:
    """The row's step; None for a line a killed process left half-written (fields missing)."""
    if None in row.values() or None in row:
        return None
    try:
        return int(float(row["step"]))
    except (KeyError, TypeError, ValueError):
        return None


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` that keeps a resumed run's earlier rows when ``resuming`` is set (see the module docstring)."""

    def __init__(self, *args, resuming: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.resuming = resuming  # read when the writer is made, at the first log

    @property
    @rank_zero_experiment
    def experiment(self) -> _KeepingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir, keep=self.resuming)
        return self._experiment
