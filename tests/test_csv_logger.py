"""ResumableCSVLogger: a run resumed in its own directory keeps the rows it logged before it stopped."""

import csv

from gatedprune.training.csv_logger import ResumableCSVLogger


def _log(directory, steps, key="train/loss", resuming=True):
    logger = ResumableCSVLogger(save_dir=str(directory), name="csv", version="", resuming=resuming)
    for step in steps:
        logger.log_metrics({key: float(step) / 10}, step=step)
    logger.save()


def _rows(directory):
    with open(directory / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_logger_keeps_the_rows_before_its_first_step_and_replaces_the_rest(tmp_path):
    _log(tmp_path, range(0, 40, 5), resuming=False)  # the killed process logged steps 0-35
    _log(tmp_path, range(25, 50, 5), key="val/bleu")  # resumed from the checkpoint at step 25, a new column
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == list(range(0, 50, 5))
    assert [r["train/loss"] for r in rows] == [str(s / 10) for s in range(0, 25, 5)] + [""] * 5  # 25-35 replaced
    assert [r["val/bleu"] for r in rows] == [""] * 5 + [str(s / 10) for s in range(25, 50, 5)]
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["metrics.csv"]  # no partial file left


def test_a_half_written_last_line_or_an_empty_file_leaves_only_the_whole_rows(tmp_path):
    _log(tmp_path, range(0, 20, 5))
    path = tmp_path / "csv" / "metrics.csv"
    path.write_text(path.read_text() + "0.")  # SIGKILL in the middle of a line
    _log(tmp_path, range(10, 20, 5))
    assert [int(r["step"]) for r in _rows(tmp_path)] == [0, 5, 10, 15]
    path.write_text("")
    _log(tmp_path, range(10, 20, 5))
    assert [(r["step"], r["train/loss"]) for r in _rows(tmp_path)] == [("10", "1.0"), ("15", "1.5")]


def test_a_run_that_does_not_resume_replaces_an_old_file_whatever_steps_it_logs(tmp_path):
    _log(tmp_path, range(0, 40, 5))
    _log(tmp_path, range(9, 20, 10), key="other", resuming=False)  # a fresh run logging from step 9 keeps no old row
    assert [(r["step"], r["other"]) for r in _rows(tmp_path)] == [("9", "0.9"), ("19", "1.9")]
    assert "train/loss" not in _rows(tmp_path)[0]
