"""``gatedprune-export --format``: a model directory (an export, or a stock dense model) and a run convert, verified
in their runtime; bad combinations are one line, exit 2, and leave no directory."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from helpers import ROOT, error_line, run_train
from gatedprune.cli import export_command

pytest.importorskip("ctranslate2")

OLD_RUN = ROOT / "tests" / "data" / "run_0.1.0"  # a run and its export, with a tokenizer and validation pairs


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    return run


def test_an_export_directory_converts_to_ct2_with_its_tokenizer(old_run, tmp_path):
    out = tmp_path / "ct2"
    assert export_command([str(old_run / "pruned"), str(out), "--format", "ct2", "--samples", "3"]) == 0
    report = json.loads((out / "deploy_report.json").read_text())
    assert report["verification"]["passed"] and report["family"] == "mbart"
    assert {"model.bin", "shared_vocabulary.json", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    vocabulary = json.loads((out / "shared_vocabulary.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the tokenizer travelled with the model
    assert all(vocabulary[i] == token for token, i in tokenizer.get_vocab().items())  # one token per id, its own


def test_a_run_converts_through_its_verified_export(old_run, tmp_path):
    out = tmp_path / "ct2"
    assert export_command([str(old_run), str(out), "--format", "ct2", "--quantization", "int8"]) == 0
    report = json.loads((out / "deploy_report.json").read_text())
    assert report["quantization"] == "int8" and report["quantized"]["translated"] == report["verification"][
        "greedy_sequences"] == 8  # the run's validation pairs (--samples 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "run"]  # the intermediate export is gone


def test_a_conversion_never_replaces_its_source(old_run, tmp_path, capsys):
    for source, out in ((old_run, old_run), (old_run, old_run / "pruned"), (old_run / "pruned", old_run / "pruned")):
        assert export_command([str(source), str(out), "--format", "ct2", "--overwrite"]) == 2
        assert "source" in capsys.readouterr().err
    assert (old_run / "checkpoints" / "last.ckpt").is_file() and (old_run / "pruned" / "config.json").is_file()


def test_train_refuses_deploy_settings_before_training(model_of):
    from gatedprune.methods.random_draw import Random
    from gatedprune.shipping.export import ExportConfig

    with pytest.raises(ValueError, match="--quantization int3 is not one of CTranslate2's"):
        ExportConfig(formats=["hf", "ct2"], quantization="int3")
    with pytest.raises(ValueError, match=r"export.formats=\['ct2'\] leaves out hf"):
        ExportConfig(formats=["ct2"])
    with pytest.raises(ValueError, match="export.formats='tflite' is not a format; allowed: hf, ct2, onnx, hf-portable"):
        ExportConfig(formats=["hf", "tflite"])
    with pytest.raises(ValueError, match="--format ct2 covers bart, mbart, marian, m2m_100, t5, mt5; this model is pegasus"):
        ExportConfig(formats=["hf", "ct2"]).check_model(model_of("pegasus"))
    with pytest.raises(ValueError, match="whose levels are exported as hf only"):
        Random().check_export(ExportConfig(formats=["hf", "ct2"]))


@pytest.mark.parametrize("args, message", [
    (["{pruned}", "--format", "hf"], "is already a Hugging Face model directory; --format hf exports a run"),
    (["{pruned}", "--format", "onnx", "--quantization", "int8"], "--quantization int8 with --format onnx"),
    (["{pruned}", "--format", "ct2", "--samples", "0"], "--samples=0 is below 1"),
    (["{pruned}", "--format", "ct2", "--top-k", "4"], "--top-k 4 with a model directory"),
    (["{missing}", "--format", "ct2"], "no run directory, checkpoint or model directory at"),
])
def test_bad_combinations_are_refused_in_one_line(old_run, tmp_path, capsys, args, message):
    args = [a.format(pruned=old_run / "pruned", missing=tmp_path / "nothing") for a in args]
    out = tmp_path / "out"
    assert export_command([args[0], str(out), *args[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_format_that_cannot_hold_the_plan_fails_the_run_after_its_metrics(tmp_path):
    """train.py with export.formats=[hf,hf-portable] on a run that removes heads from mBART (whose stock class
    cannot hold them): the hf export ships and metrics.json describes it, the refusal is recorded under deploy,
    nothing is written for it, and the run fails in one line."""
    run = tmp_path / "run"
    proc = run_train(run, "pruning.l0_lambda=20", "pruning.gate_lr=0.5", "export.formats=[hf,hf-portable]")
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc)
    assert line.startswith("error: hf-portable: ") and "the Hugging Face export is shipped and verified" in line
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["export"]["verification"]["passed"] and metrics["deploy"]["hf-portable"]["dir"] is None
    assert not (run / "deploy" / "hf-portable").exists()
