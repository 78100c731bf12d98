"""What a hostile but realistic user does: hands us a checkpoint that runs code, lets a run diverge, exports a run
onto itself, starts two runs in one directory, kills an export, feeds files with headers, empty lines and bad bytes.
Each case is refused or handled with one line, and nothing on disk is lost or half-written."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import compose_train, error_line, gated_module, offline_env, run_train
from gatedprune import attach_gates
from gatedprune.shipping import export, export_dir
from gatedprune.training import rundir
from gatedprune.cli import export_command
from gatedprune.data import read_pairs_file
from gatedprune.methods.gated import L0
from gatedprune.training.module import GenerationConfig, OptimConfig
from gatedprune.train import train
from gatedprune.utils import check_numbers, write_json


def _strict_json(path: Path):
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(compose_train(run_dir, "experiment=smoke"))
    return run_dir


# --- 1. no code runs from a checkpoint -------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this runs ``touch <marker>``: what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _malicious_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory whose last.ckpt has every key the loader checks, plus an object that runs a command."""
    marker = tmp_path / "code-ran"
    run = tmp_path / "downloaded"
    (run / "checkpoints").mkdir(parents=True)
    (run / "tokenizer").mkdir()
    checkpoint = {
        "state_dict": {"gates.gates.0.log_alpha": torch.zeros(4)}, "hf_config": {"model_type": "mbart"},
        "gate_kinds": ["encoder"], "gate_options": {}, "payload": _RunsCode(marker),
    }
    torch.save(checkpoint, run / "checkpoints" / "last.ckpt")
    return run / "checkpoints" / "last.ckpt", marker


def test_a_checkpoint_that_would_run_code_is_refused_by_export_and_resume(tmp_path):
    checkpoint, marker = _malicious_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "export", str(checkpoint), str(tmp_path / "out")],
                          capture_output=True, text=True, env=offline_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "posix.system" in error_line(proc) and "could run code" in error_line(proc)
    assert not marker.exists() and not (tmp_path / "out").exists()

    proc = run_train(tmp_path / "run", f"resume={checkpoint}")
    assert proc.returncode == 2 and "posix.system" in error_line(proc), proc.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_lightning_resume_loads_weights_only_too(tmp_path, monkeypatch):
    # take gatedprune's own check away: Lightning's load of the same file must refuse it by itself
    from gatedprune.data import load_bible_pairs, train_unigram_tokenizer

    checkpoint, marker = _malicious_run(tmp_path)
    texts = [t for pair in load_bible_pairs()[:400] for t in pair]
    train_unigram_tokenizer(texts, 400).save_pretrained(checkpoint.parents[1] / "tokenizer")
    monkeypatch.setattr("gatedprune.training.checkpoints.load_checkpoint_file", lambda path: {})
    monkeypatch.setattr("gatedprune.training.checkpoints.check_resumable", lambda *args: [])
    with pytest.raises(Exception, match="Weights only load failed"):
        train(compose_train(tmp_path / "run", "experiment=smoke", f"resume={checkpoint}"))
    assert not marker.exists()


# --- 2. a diverged run stops -----------------------------------------------------------------------------------


def test_non_finite_losses_count_although_the_optimizer_hook_sees_no_gradient(tmp_path):
    # Lightning runs on_before_optimizer_step after a training_step that returned None, with no gradients at all:
    # that must not count as a good step, or the run never stops
    module = gated_module(tmp_path)
    module.log = lambda *args, **kwargs: None
    module._cross_entropy = lambda batch, smoothing: torch.tensor(float("inf"))
    optimizer = torch.optim.AdamW(module.parameters())
    batch = {"labels": torch.ones(1, 2, dtype=torch.long)}
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        assert module.training_step(batch, step) is None
        module.on_before_optimizer_step(optimizer)
    with pytest.raises(FloatingPointError, match=r"3 steps in a row"):
        module.training_step(batch, 2)


def test_non_finite_weights_are_never_saved(tmp_path):
    module = gated_module(tmp_path)
    with torch.no_grad():
        next(module.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match="weights are not finite"):
        module.on_save_checkpoint({})


def test_a_run_whose_weights_blow_up_stops_with_one_line_and_keeps_finite_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "optim.lr=1e12")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "10 steps in a row had a non-finite loss or gradient" in error_line(proc)
    assert _strict_json(run_dir / "status.json")["status"] == "failed"
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "pruned").exists()
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v))


@pytest.mark.parametrize("section, config", [("pruning", L0), ("optim", OptimConfig),
                                             ("generation", GenerationConfig)])
def test_every_float_option_refuses_nan_and_inf_in_its_own_words(section, config):
    import dataclasses

    floats = [f for f in dataclasses.fields(config) if isinstance(f.default, float) or (
        isinstance(f.default, tuple) and isinstance(f.default[0], float))]
    assert floats
    for field in floats:
        for bad in (float("nan"), float("inf"), float("-inf")):
            value = (bad, *field.default[1:]) if isinstance(field.default, tuple) else bad
            with pytest.raises(ValueError, match=rf"^{section}\.{field.name}=.* is not a finite number"):
                config(**{field.name: value})
    with pytest.raises(ValueError, match=rf"{section}\.{floats[0].name}='x' is not a number"):
        check_numbers(section, dataclasses.replace(config(), **{floats[0].name: "x"}))


def test_metrics_are_always_valid_json(tmp_path, finished_run):
    write_json(tmp_path / "m.json", {"loss": float("inf"), "per_kind": [float("nan"), 1.5]})
    assert _strict_json(tmp_path / "m.json") == {"loss": None, "per_kind": [None, 1.5]}
    assert _strict_json(finished_run / "metrics.json")["steps"] == 30


# --- 3. export never destroys its source -----------------------------------------------------------------------


def test_export_refuses_to_write_over_its_source(finished_run, tmp_path, capsys):
    before = sorted(p.relative_to(finished_run) for p in finished_run.rglob("*"))
    checkpoint = finished_run / "checkpoints" / "last.ckpt"
    for source, out, says in [
        (finished_run, finished_run, "is or contains the source"),
        (finished_run, finished_run.parent, "is or contains the source"),
        (checkpoint, finished_run, "is or contains the source"),
        (finished_run, finished_run / "checkpoints" / "pruned", "inside the run's checkpoints/"),
        (checkpoint, finished_run / "checkpoints", "is or contains the source"),
        (finished_run / "checkpoints" / "last.ckpt", finished_run / "checkpoints" / "x", "inside the run's checkpoints/"),
    ]:
        assert export_command([str(source), str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: output directory") and says in err[0], err
    assert sorted(p.relative_to(finished_run) for p in finished_run.rglob("*")) == before


def test_train_refuses_an_export_directory_that_would_replace_the_run(tmp_path):
    with pytest.raises(ValueError, match="is or contains the source"):
        train(compose_train(tmp_path / "run", "experiment=smoke", f"export.out_dir={tmp_path / 'run'}"))
    assert not (tmp_path / "run").exists()


# --- 4. one process per run directory --------------------------------------------------------------------------


def test_a_run_directory_is_locked_while_its_process_lives(tmp_path):
    held = rundir.lock(tmp_path)
    with pytest.raises(rundir.RunDirBusy, match=rf"in use by process {os.getpid()}"):
        rundir.lock(tmp_path)
    rundir.unlock(held)
    rundir.unlock(rundir.lock(tmp_path))

    # a holder killed with SIGKILL leaves the file, not the lock
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from pathlib import Path; from gatedprune.training.rundir import lock; lock(Path({str(tmp_path)!r})); "
         "print('locked', flush=True); import time; time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=offline_env(),
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(rundir.RunDirBusy, match=rf"in use by process {holder.pid}"):
        rundir.lock(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    rundir.unlock(rundir.lock(tmp_path))


def test_a_second_run_in_a_busy_run_directory_is_refused_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    held = rundir.lock(run_dir)
    try:
        proc = run_train(run_dir)
    finally:
        rundir.unlock(held)
    assert proc.returncode == 2 and f"run directory {run_dir} is in use by process {os.getpid()}" in error_line(proc)
    # Hydra opens its log file (appending) before any of our code runs; nothing goes into it
    assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK_FILE, "train.log"]
    assert (run_dir / "train.log").stat().st_size == 0


# --- 5. a killed export leaves nothing that lasts --------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_partial_exports_of_dead_processes_are_removed(model_of, tmp_path, caplog, monkeypatch):
    dead, live = _dead_pid(), os.getppid()
    for name in (f".out.partial-{dead}", ".out.partial", f".out.partial-{live}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("half")
    staged = []
    write_card = export_dir.write_card
    monkeypatch.setattr(export_dir, "write_card", lambda d, *a: (staged.append(d.name), write_card(d, *a)))
    model = model_of("bart")
    gates = attach_gates(model)
    with caplog.at_level("WARNING"):
        export.export_gated(model, gates, tmp_path / "out")
    assert staged == [f".out.partial-{os.getpid()}"]  # this process's own name
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.partial-{live}", "out"]
    assert f"removed {tmp_path / f'.out.partial-{dead}'}, left by an export (process {dead})" in caplog.text


def test_an_export_killed_between_its_two_renames_gets_its_previous_directory_back(tmp_path):
    old = tmp_path / f".out.old-{_dead_pid()}"
    old.mkdir()
    (old / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not empty"):
        export_dir.check_target(tmp_path / "out", overwrite=False)
    assert (tmp_path / "out" / "config.json").read_text() == "{}" and not old.exists()


# --- 6. one line where the README promises one -----------------------------------------------------------------


def test_a_failed_export_verification_in_train_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "trainer.max_steps=12", prefix=["import gatedprune.shipping.export as e", "e.TOLERANCE = -1.0"])
    assert proc.returncode == 1 and "verification failed, nothing written to" in error_line(proc)
    assert _strict_json(run_dir / "status.json")["status"] == "failed" and not (run_dir / "pruned").exists()
    # the gated model's numbers stay, saying what they are; no claim about a test split that was never reached
    metrics = _strict_json(run_dir / "metrics.json")
    assert metrics["model"].startswith("gated") and "scored after the export" in metrics["test"]["note"]


def test_resuming_a_checkpoint_of_another_model_names_the_fields(finished_run, tmp_path):
    proc = run_train(tmp_path / "run", f"resume={finished_run}", "model.from_scratch.d_model=64")
    assert proc.returncode == 2 and "d_model (checkpoint 32, config 64)" in error_line(proc)
    assert not (tmp_path / "run").exists()
    proc = run_train(tmp_path / "run", f"resume={finished_run}", "pruning.kinds=[encoder]")
    assert proc.returncode == 2 and "but pruning.kinds is ['encoder']" in error_line(proc)


# --- 7. messages that say where and what -----------------------------------------------------------------------


def test_data_file_errors_name_the_file_and_line(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"en": "a", "fr": "b"}\n\n{"en": "c", "fr": \n')
    with pytest.raises(ValueError, match=rf"^{bad_json}:3: not valid JSON"):
        read_pairs_file(bad_json, "en", "fr")
    bad_bytes = tmp_path / "bad.tsv"
    bad_bytes.write_bytes(b"a\tb\nc\xff\td\n")
    with pytest.raises(ValueError, match=rf"^{bad_bytes}:2: not valid UTF-8 \(byte 0xff\)"):
        read_pairs_file(bad_bytes, "en", "fr")


def test_export_of_a_directory_without_a_run_says_what_is_missing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert export_command([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'empty'} holds neither metrics.json nor checkpoints/last.ckpt; "
                   "give a run directory or a .ckpt file"]


# --- 8. what used to be accepted silently ----------------------------------------------------------------------


def test_tsv_header_lines_are_detected_and_empty_pairs_dropped(tmp_path, capsys):
    from gatedprune.data import FilesData

    rows = ["en\tfr", "one\tun", "two\t", "\tdeux", "  \t  ", "three\ttrois"]
    for split in ("train", "validation"):
        (tmp_path / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    assert read_pairs_file(tmp_path / "train.tsv", "en", "fr")[0] == ("one", "un")  # detected
    assert read_pairs_file(tmp_path / "train.tsv", "en", "fr", header=False)[0] == ("en", "fr")
    (tmp_path / "plain.tsv").write_text("one\tun\n")
    assert read_pairs_file(tmp_path / "plain.tsv", "en", "fr") == [("one", "un")]  # a pair is not a header
    assert read_pairs_file(tmp_path / "plain.tsv", "en", "fr", header=True) == []
    capsys.readouterr()

    files = {split: str(tmp_path / f"{split}.tsv") for split in ("train", "validation")}
    pairs = FilesData(files=files).load_pairs()
    assert pairs["train"] == pairs["validation"] == [("one", "un"), ("three", "trois")]
    out = capsys.readouterr().out
    assert f"{tmp_path / 'train.tsv'}: skipped the header line ('en', 'fr')" in out
    assert "split 'train': dropped 3 of 5 pairs with an empty source or target" in out


def test_nested_gate_options_refuse_nan_and_inf_by_their_full_name():
    from gatedprune.methods.gated import L0Budget

    for field, value in (("temperature", float("inf")), ("init_log_alpha", float("nan")), ("stretch", [-0.1, float("inf")])):
        with pytest.raises(ValueError, match=rf"^pruning\.gates\.{field}=.* is not a finite number"):
            L0Budget(gates={field: value})


def test_bad_input_in_a_directory_that_held_something_keeps_it(tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    proc = run_train(run_dir, "pruning.l0_lambda=-1")
    assert proc.returncode == 2 and "is negative" in error_line(proc)
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_a_finished_run_relaunched_in_its_directory_finishes_again(tmp_path):
    # resume=auto continues from its own last.ckpt (already at max_steps); the export replaces its own pruned/
    overrides = ("experiment=smoke", "trainer.max_steps=12")
    first = train(compose_train(tmp_path / "run", *overrides))
    again = train(compose_train(tmp_path / "run", *overrides))
    assert again["steps"] == first["steps"] == 12 and again["plan"] == first["plan"]
    assert _strict_json(tmp_path / "run" / "status.json")["status"] == "done"
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".pruned")) == []
