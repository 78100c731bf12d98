"""A CSV logger whose resumed run keeps the rows it logged before it stopped.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when its directory exists, so a run continued with
``resume=auto`` would keep only the steps after the resume. This one keeps the old rows up to the first step the
new process logs: a run killed at step 37 and resumed from its checkpoint at step 30 logs steps 30-37 again (same
data order), and those rows replace the killed process's ones, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _KeepingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:  # called by __init__; Lightning's deletes the file here
        self.earlier: list[dict] | None = None
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.earlier = list(csv.DictReader(file))

    def save(self) -> None:
        if self.metrics and self.earlier is not None:  # the first save of this process: merge, then append as usual
            first = min(row["step"] for row in self.metrics)
            kept = [row for row in self.earlier if _step(row) is not None and _step(row) < first]
            self.earlier = None
            if not kept:
                self._fs.rm_file(self.metrics_file_path)
            else:
                keys = sorted({key for row in kept for key, value in row.items() if value not in ("", None)})
                with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                    writer = csv.DictWriter(file, fieldnames=keys, extrasaction="ignore")
                    writer.writeheader()
                    writer.writerows(kept)
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
    """``CSVLogger`` that appends to an existing ``metrics.csv`` (see the module docstring)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _KeepingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return self._experiment
