"""ResumableCSVLogger: a resumed run's metrics.csv reads as one uninterrupted run."""

import csv

from gatedprune.csv_logger import ResumableCSVLogger


def _log(directory, steps, key="train/loss", final=True):
    logger = ResumableCSVLogger(save_dir=str(directory), name="csv", version="")
    for step in steps:
        logger.log_metrics({key: float(step) / 10}, step=step)
    if final:
        logger.save()
    return logger


def _rows(directory):
    with open(directory / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_logger_keeps_the_rows_before_its_first_step_and_replaces_the_rest(tmp_path):
    _log(tmp_path, range(0, 40, 5))  # the killed process logged steps 0-35
    _log(tmp_path, range(25, 50, 5), key="val/bleu")  # resumed from the checkpoint at step 25, a new column
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == list(range(0, 50, 5))
    assert [r["train/loss"] for r in rows] == [str(s / 10) for s in range(0, 25, 5)] + [""] * 5  # 25-35 replaced
    assert [r["val/bleu"] for r in rows] == [""] * 5 + [str(s / 10) for s in range(25, 50, 5)]


def test_a_half_written_last_line_is_dropped_and_a_fresh_run_starts_a_fresh_file(tmp_path):
    _log(tmp_path, range(0, 20, 5))
    path = tmp_path / "csv" / "metrics.csv"
    path.write_text(path.read_text() + "0.")  # SIGKILL in the middle of a line
    _log(tmp_path, range(10, 20, 5))
    assert [int(r["step"]) for r in _rows(tmp_path)] == [0, 5, 10, 15]
    _log(tmp_path, range(0, 10, 5), key="other")  # a run from step 0 in the same folder keeps none of the old rows
    assert [(r["step"], r["other"]) for r in _rows(tmp_path)] == [("0", "0.0"), ("5", "0.5")]
    assert "train/loss" not in _rows(tmp_path)[0]
