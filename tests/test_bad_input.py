"""Each kind of bad input: one line naming the value and what is allowed, exit code 2, nothing left on disk."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from families import tiny_model
from helpers import offline_env, run_train

CONF = Path(__file__).resolve().parents[1] / "conf"


def _options(group):
    """Hydra's list of a config group's choices, from the files themselves: a new preset must not break this test."""
    return "; ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))


def _run(tmp_path, *overrides, flags=()):
    run_dir = tmp_path / "run"
    return run_train(run_dir, *overrides, flags=flags, cwd=tmp_path), run_dir


def _assert_refused(proc, run_dir, *fragments):
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = proc.stderr.strip().splitlines()  # nothing else: set-up chatter comes after validation
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_missing_language_columns_are_named(tmp_path):
    rows = "".join(json.dumps({"english": f"a{i}", "french": f"b{i}"}) + "\n" for i in range(5))
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text(rows)
    proc, run_dir = _run(
        tmp_path, "data=files", f"data.files.train={tmp_path}/train.jsonl",
        f"data.files.validation={tmp_path}/validation.jsonl",
    )
    _assert_refused(proc, run_dir, "no column 'en'", "['english', 'french']")


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("pruning.l0_lambda=-0.1", ["pruning.l0_lambda=-0.1 is negative; allowed: a number >= 0"]),
        ("pruning.kinds=[encoder,self]", ["unknown kind(s) ['self'] in pruning.kinds; allowed: encoder, decoder, cross, encoder_ffn, decoder_ffn, encoder_layer, decoder_layer"]),
        ("pruning.gates.temperature=0", ["gate temperature must be > 0, got 0"]),
        ("pruning.gates.temperature=inf", ["pruning.gates.temperature=inf is not a finite number"]),
        ("data=web", ["Could not find 'data/web'", f"Available options in 'data': {_options('data')}"]),
        ("model.name_or_path=./no/such/model", ["no tokenizer at './no/such/model' (data.tokenizer_path, by default"]),
        ("pruning.gates.stretch=[0.1,1.1]", ["gamma < 0 < 1 < zeta, got (0.1, 1.1)"]),
        ("pruning.gates.stretch=[-0.1,0.9]", ["got (-0.1, 0.9)"]),
        ("pruning.penalty_normalisation=mean", ["penalty_normalisation='mean'", "layer_mean, sum, head_mean"]),
        ("pruning=l0_budget pruning.target_heads=100", ["target_heads=100 for total: allowed a count from 0 to the 24"]),
        ("data.max_length=2", ["longer than max_length=2"]),
        ("data.bible_tgt=zz", ["unknown bible translation code 'zz'"]),
        ("optim.lr=0", ["optim.lr=0", "allowed: a number > 0"]),
        ("resume=/no/such/run", ["resume='/no/such/run': no checkpoint at"]),
        ("pruning.l0_lambda=inf", ["pruning.l0_lambda=inf is not a finite number"]),
        ("pruning.l0_lambda=nan", ["pruning.l0_lambda=nan is not a finite number"]),
        ("optim.lr=fast", ["optim.lr='fast' is not a number"]),
        ("pruning.l0_lamda=0.1", ["Could not override 'pruning.l0_lamda': Key 'l0_lamda' is not in struct",
                                  "+pruning.l0_lamda=0.1"]),
        ("pruning=l1", ["Could not find 'pruning/l1'", f"Available options in 'pruning': {_options('pruning')}"]),
        ("model=pretrained", ["Missing mandatory value: data.tokenizer_path"]),
        ("export.rule=topk", ["export.rule='topk'; allowed: binary, top-k"]),
        ("export.top_k=5", ["export.rule=binary with export.top_k=5; allowed: top_k (a head count) with rule top-k only"]),
    ],
)
def test_bad_config_values(tmp_path, override, fragments):
    _assert_refused(*_run(tmp_path, *override.split()), *fragments)


def test_ddp_in_a_local_multirun_is_refused(tmp_path):
    # Lightning starts DDP processes by re-running the command line: under -m each would re-run the sweep
    proc, _ = _run(tmp_path, "trainer=ddp_cpu", f"hydra.sweep.dir={tmp_path / 'sweep'}", flags=["-m"])
    assert proc.returncode == 2, proc.stderr[-3000:]  # every member refused as bad input: the sweep's exit is 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: 1 of 1 sweep members failed: 0 (")
    assert "trainer.strategy=lightning.pytorch.strategies.DDPStrategy with -m" in errors[0]
    # a sweep member keeps its directory, with its failure, for the sweep's summary to list (no checkpoint in it)
    status = json.loads((tmp_path / "sweep" / "0" / "status.json").read_text())
    assert status["status"] == "failed" and "DDPStrategy with -m" in status["error"]
    assert not (tmp_path / "sweep" / "0" / "checkpoints").exists()


def test_unknown_split_of_a_local_dataset(tmp_path):
    import datasets

    rows = {"en": ["a b", "c d"], "fr": ["e f", "g h"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "dev": datasets.Dataset.from_dict(rows)}).save_to_disk(
        tmp_path / "ds"
    )
    proc, run_dir = _run(tmp_path, "data=hf", f"data.hf_name={tmp_path / 'ds'}")
    _assert_refused(proc, run_dir, "'validation'", "dev")


def test_unsupported_model_class(tmp_path):
    model_dir = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=500, bos_token_id=0, eos_token_id=0)).save_pretrained(model_dir)
    tokenizer_dir = tmp_path / "tok"
    _trained_tokenizer(tmp_path).save_pretrained(tokenizer_dir)
    proc, run_dir = _run(tmp_path, "model=pretrained", f"model.name_or_path={model_dir}",
                         f"data.tokenizer_path={tokenizer_dir}")
    _assert_refused(proc, run_dir, "(gpt2): unsupported model class: a 'gpt2' config has no encoder-decoder class")


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    model = tiny_model("marian", tmp_path)  # vocabulary of 99
    _trained_tokenizer(tmp_path).save_pretrained(tmp_path / "marian")  # 400 tokens, beside the model
    proc, run_dir = _run(tmp_path, "model=pretrained", f"model.name_or_path={tmp_path / 'marian'}")
    assert model.config.vocab_size == 99
    _assert_refused(proc, run_dir, "tokenizer has 400 tokens but model", "vocabulary of 99")


def _trained_tokenizer(tmp_path):
    from gatedprune.data import load_bible_pairs, train_unigram_tokenizer

    texts = [t for pair in load_bible_pairs()[:400] for t in pair]
    return train_unigram_tokenizer(texts, 400)


def test_exporter_refuses_corrupt_and_gateless_checkpoints(tmp_path):
    from gatedprune.cli import export_command as main

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    assert main([str(truncated), str(tmp_path / "out1")]) == 2
    assert not (tmp_path / "out1").exists()

    gateless = tmp_path / "gateless.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(1)}, "hf_config": {"model_type": "bart"}}, gateless)
    assert main([str(gateless), str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2").exists()


def test_exporter_errors_are_one_line(tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(b"garbage")
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "export", str(truncated), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=tmp_path, env=offline_env(), timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "truncated.ckpt" in lines[0] and "not a readable checkpoint" in lines[0]
    assert "Traceback" not in proc.stderr


def test_resume_from_a_truncated_checkpoint_is_refused(tmp_path):
    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "tokenizer").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"garbage")
    proc, run_dir = _run(tmp_path, f"resume={run}")
    _assert_refused(proc, run_dir, "is not a readable checkpoint")


def test_an_empty_model_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc, run_dir = _run(tmp_path, "model=pretrained", f"model.name_or_path={tmp_path / 'empty'}")
    _assert_refused(proc, run_dir, "the directory holds no tokenizer files")
