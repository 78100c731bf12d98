"""Inputs that became a default, did nothing or gave a traceback (issue 26, items 6, 8 and 9 for evaluate, analyze,
the methods and checkpoints): each is refused in one line naming the value and what is allowed, before the work."""

import dataclasses
import pickle
import shutil
import subprocess
import sys

import pytest

from helpers import error_line, offline_env, run_train
from gatedprune.cli import analyze_command, evaluate_command, export_command

SHORT = ("trainer.max_steps=12", "dense_steps=4", "trainer.val_check_interval=6",  # a shorter smoke run
         "callbacks.checkpoint.every_n_train_steps=6", "optim.warmup_steps=4", "export.samples=8")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short smoke run with its export (run/pruned)."""
    run = tmp_path_factory.mktemp("inputs") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # tiny matrices: two threads on a shared 2-core box only fight
        proc = run_train(run, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _no_evaluation(monkeypatch):
    """Make loading a model or evaluating fail the test: a refusal must come before either."""
    import gatedprune.reports.evaluate as evaluate

    def called(*args, **kwargs):
        raise AssertionError("the model was loaded or evaluated before the input was refused")

    monkeypatch.setattr(evaluate, "load_seq2seq", called)
    return evaluate


# ---- item 6: numbers that silently became defaults


@pytest.mark.parametrize("option, value", [("--num-beams", "0"), ("--batch-size", "0"), ("--num-beams", "-2")])
def test_evaluate_refuses_counts_below_one_before_loading(run, monkeypatch, capsys, option, value):
    _no_evaluation(monkeypatch)
    assert evaluate_command([str(run / "pruned"), option, value, "--out", str(run / "x.json")]) == 2
    assert f"{option} {value}; allowed: an integer >= 1" in _one_error(capsys)
    assert not (run / "x.json").exists()


def test_a_negative_target_ramp_is_refused():
    from gatedprune.methods.gated import L0Budget

    with pytest.raises(ValueError, match=r"^pruning.target_warmup_steps=-1 is negative; allowed: an integer >= 0$"):
        L0Budget(target_warmup_steps=-1)
    assert L0Budget(target_warmup_steps=0).target_warmup_steps == 0


# ---- item 8: --out checked first; an export with no heads left


def test_evaluate_refuses_an_out_that_cannot_be_written_before_evaluating(run, tmp_path, monkeypatch, capsys):
    evaluate = _no_evaluation(monkeypatch)
    monkeypatch.setattr(evaluate, "evaluate_dir", lambda *a, **k: pytest.fail("evaluated before --out was checked"))
    folder = tmp_path / "folder"
    folder.mkdir()
    assert evaluate_command([str(run / "pruned"), "--out", str(folder)]) == 2
    assert f"--out {folder} is a directory; allowed: a file path" in _one_error(capsys)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert evaluate_command([str(run / "pruned"), "--out", str(blocker / "eval.json")]) == 2
    assert f"--out {blocker / 'eval.json'}: {blocker} is a file, not a directory" in _one_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"] and not any(folder.iterdir())


def test_analyze_refuses_an_export_with_no_heads_left(run, capsys):
    empty = run / "no_heads"
    assert export_command([str(run), str(empty), "--top-k", "0"]) == 0
    capsys.readouterr()
    assert analyze_command([str(empty), "--max-pairs", "4"]) == 2
    assert f"{empty} has no attention heads left (every one was pruned): nothing to analyse" in _one_error(capsys)
    assert not (empty / "analysis").exists()


# ---- item 9: smaller things


def test_analyze_outside_any_run_needs_data_overrides(run, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(run / "pruned", model)  # a model directory outside any run
    assert analyze_command([str(model), "--max-pairs", "4"]) == 2
    says = _one_error(capsys)
    assert f"{model} lies outside any run, so its data is not recorded" in says and "data=bible" in says
    assert "data=files data.files.validation=" in says and not (model / "analysis").exists()
    # with overrides it works (the built-in data, asked for), and a model inside a run still needs none
    assert analyze_command([str(model), "--max-pairs", "4", "data=bible", "data.max_val_pairs=8"]) == 0
    assert (model / "analysis" / "heads.csv").is_file()
    assert analyze_command([str(run / "pruned"), "--max-pairs", "4", "--out", str(tmp_path / "inside")]) == 0
    assert (tmp_path / "inside" / "heads.csv").is_file()


def test_a_refused_evaluate_prints_one_line_only(run, tmp_path):
    # refused after the model loaded (the data has no test split): transformers' loading bar stays quiet
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "evaluate", str(run / "pruned"), "data=files",
                           "data.files.train=null", "data.files.validation=null", "--out", str(tmp_path / "e.json")],
                          capture_output=True, text=True, env=offline_env(OMP_NUM_THREADS="1"), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2 and "has no entry for split 'test'" in error_line(proc)
    assert proc.stderr.strip().splitlines() == [error_line(proc)], proc.stderr


@dataclasses.dataclass
class Settings:  # what a plain pickle of a user's own object imports
    lr: float = 0.1


def test_a_plain_pickle_checkpoint_is_named_for_what_it_holds(tmp_path):
    import torch

    from gatedprune.training.checkpoints import load_checkpoint_file

    with open(tmp_path / "object.ckpt", "wb") as f:
        pickle.dump({"state_dict": {}, "settings": Settings()}, f)
    torch.save({"state_dict": {"w": torch.zeros(2)}, "settings": Settings()}, tmp_path / "v4.ckpt", pickle_protocol=4)
    for name in ("object.ckpt", "v4.ckpt"):  # a pickle of protocol 4: torch's loader stops at its first opcode
        with pytest.raises(ValueError) as err:
            load_checkpoint_file(tmp_path / name)
        assert str(err.value) == (f"{tmp_path / name} asks to load {__name__}.Settings, not only tensors and plain "
                                  "data: loading it could run code, so it is refused (give a checkpoint written by "
                                  "gatedprune's train.py)")
    # nothing but data and tensors (their rebuild functions are allowed): the opcode is what is refused
    with open(tmp_path / "data.ckpt", "wb") as f:
        pickle.dump({"state_dict": {"a": [1, 2]}}, f)
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "tensors.ckpt", pickle_protocol=4)
    for name in ("data.ckpt", "tensors.ckpt"):
        with pytest.raises(ValueError, match=f"^{tmp_path / name} holds pickle opcode FRAME, which weights_only "
                                             "loading refuses; give a checkpoint written by gatedprune's train.py$"):
            load_checkpoint_file(tmp_path / name)
    # on the command line: the one line, no warning from torch's unpickler before it
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "export", str(tmp_path / "object.ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True, env=offline_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2 and "Settings" in error_line(proc)
    assert proc.stderr.strip().splitlines() == [error_line(proc)], proc.stderr


def test_no_attention_kinds_is_refused_with_the_kinds_there_are():
    from gatedprune.structures.kinds import ALL_KINDS, check_kinds

    for kinds in ([], ()):
        with pytest.raises(ValueError) as err:
            check_kinds(kinds)
        assert str(err.value) == f"pruning.kinds=[]; allowed: one or more of {', '.join(ALL_KINDS)}"
    with pytest.raises(ValueError, match=r"unknown kind\(s\) \['self'\] in pruning.kinds; allowed: encoder, decoder"):
        check_kinds(["encoder", "self"])


@pytest.mark.parametrize("override, says", [
    ("temperature=0", "pruning.gates.temperature=0: gate temperature must be > 0, got 0"),
    ("temperature=-1", "pruning.gates.temperature=-1: gate temperature must be > 0, got -1"),
    ("eps=0.6", "pruning.gates.eps=0.6: gate eps must lie in (0, 0.5), got 0.6"),
])
def test_gate_option_errors_name_their_key(override, says):
    from gatedprune.methods.gated import L0

    name, value = override.split("=")
    with pytest.raises(ValueError) as err:
        L0(gates={name: float(value) if "." in value else int(value)})
    assert str(err.value) == says


def test_kinds_and_gate_option_errors_on_the_command_line(tmp_path):
    proc = run_train(tmp_path / "run", "pruning.kinds=[]")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert "pruning.kinds=[]; allowed: one or more of encoder, decoder, cross" in error_line(proc)
    proc = run_train(tmp_path / "run", "pruning.gates.temperature=0")
    assert proc.returncode == 2 and "pruning.gates.temperature=0: gate temperature" in error_line(proc)


@pytest.mark.parametrize("heads, says", [
    ([12, 12, 6], "pruning.heads=[12, 12, 6] names 12 heads twice; allowed: distinct head counts"),
    ([0.5, 12], "pruning.heads=[0.5, 12] names 12 heads twice (0.5 and 12 of the 24 gated heads); allowed: "
                "distinct head counts"),
])
def test_duplicate_baseline_head_counts_are_refused(heads, says):
    from gatedprune.methods.baselines import head_counts

    with pytest.raises(ValueError) as err:
        head_counts(heads, 24, "pruning.heads")
    assert str(err.value) == says
    assert head_counts([6, 0.5], 24, "pruning.heads") == [12, 6]
