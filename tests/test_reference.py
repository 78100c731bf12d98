"""reference=<json>: the final table's fair reference, the starting model trained on for the run's own steps."""

from __future__ import annotations

import json

import pytest

from helpers import refused_at_setup, run_train


def test_the_final_table_shows_the_reference_at_the_run_s_steps(tmp_path):
    # experiment=smoke: 10 dense steps, then 20 gated; 6 of fine-tuning: 26 steps after the model it starts from
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"test_bleu_at": {"20": 1.5, "26": 12.345}, "command": "the reference's"}))
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, f"reference={reference}", "finetune.steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["reference"] == {"path": str(reference), "steps": 26, "test_bleu": 12.345, "measured_at": [20, 26],
                                    "command": "the reference's"}
    header = next(line for line in proc.stdout.splitlines() if "dense (step 10)" in line)
    assert "dense + 26 steps" in header
    column = header.index("dense + 26 steps")
    test_row = next(line for line in proc.stdout.splitlines() if line.startswith("test BLEU"))
    assert test_row[column:].split()[0] == "12.35"  # its test BLEU, in its column
    valid_row = next(line for line in proc.stdout.splitlines() if line.startswith("validation BLEU"))
    assert valid_row[column:].split()[0] == "-"  # only test BLEU was measured
    assert f"dense + 26 steps: the starting model trained on as long, nothing pruned ({reference})" in proc.stdout


def test_a_reference_without_the_run_s_steps_says_so_and_adds_no_column(tmp_path):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"test_bleu_at": {"250": 20.0, "1100": 23.9}}))
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, f"reference={reference}")  # 20 gated steps, no fine-tuning
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["reference"]["test_bleu"] is None
    assert "dense + " not in proc.stdout
    assert f"reference: {reference} has no test BLEU at this run's 20 steps (it has 250, 1100)" in proc.stdout


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("{not json", "not json"),
    (json.dumps({"test_bleu_at": {}}), "no test_bleu_at"),
    (json.dumps({"test_bleu_at": {"x": 1.0}}), "no test_bleu_at"),
    (json.dumps({"test_bleu_at": {"100": "high"}}), "no test_bleu_at"),
    (json.dumps({"test_bleu_at": {"100": True}}), "no test_bleu_at"),
    (json.dumps([1, 2]), "no test_bleu_at"),
])
def test_a_bad_reference_is_refused_in_one_line(tmp_path, content, says):
    from gatedprune.reports.reference import load_reference

    path = tmp_path / "reference.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as refused:
        load_reference(path)
    assert str(refused.value).startswith(f"reference={path}: {says}") and "\n" not in str(refused.value)


def test_a_run_with_a_bad_reference_is_refused_at_set_up(tmp_path):
    path = tmp_path / "missing.json"
    assert f"reference={path}: no such file" in refused_at_setup(tmp_path / "run", f"reference={path}")
    path.write_text(json.dumps({"test_bleu_at": {"20": 1.0}}))  # a good file, with a method that has no column
    assert f"reference={path} with pruning=michel" in refused_at_setup(tmp_path / "other", f"reference={path}",
                                                                      "pruning=michel")


def test_a_run_from_the_kept_teacher_is_set_beside_the_teacher_trained_on(tmp_path, monkeypatch):
    from helpers import compose_train
    from helpers import load_benchmark as _load

    import gatedprune.teacher as teacher

    recovery = _load("recovery")
    cell = next(c for c in recovery._grid() if c.group == "reference")
    assert teacher.REFERENCE == recovery.RESULTS / f"{cell.name}.json"  # the cell that measures it
    made = tmp_path / "reference.json"
    made.write_text(json.dumps({"test_bleu_at": {"1100": 23.9}}))
    monkeypatch.setattr(teacher, "REFERENCE", made)
    assert compose_train(tmp_path, "model=teacher").reference == str(made)  # the default run's gates show it
    # methods whose table has no column for it (several levels, a recovery) get none, rather than a refusal
    assert compose_train(tmp_path, "model=teacher", "pruning=random").reference is None
    assert compose_train(tmp_path, "model=teacher", "reference=null").reference is None
    assert compose_train(tmp_path, "model=scratch_mbart").reference is None  # another model: not the teacher's
    monkeypatch.setattr(teacher, "REFERENCE", tmp_path / "absent.json")
    assert compose_train(tmp_path, "model=teacher").reference is None  # before the reference cell has run
