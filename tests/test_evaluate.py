"""Final numbers describe the exported model; the test split is scored for the dense and the exported model;
`gatedprune-evaluate` scores any seq2seq directory on the trainer's data."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
import transformers

from families import save_plain_mbart
from helpers import compose_train, error_line, offline_env
from gatedprune.data import load_bible_pairs, train_unigram_tokenizer
from gatedprune.cli import evaluate_command as main
from gatedprune.reports.evaluate import evaluate_dir
from gatedprune.train import train


@pytest.fixture(scope="module")
def pairs():
    return load_bible_pairs(max_chars=80)[:300]


def _write_tsv(path, pairs):
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    return path


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "run"
    return out, train(compose_train(out, "experiment=smoke", "pruning=l0_budget", "pruning.target_heads=5"))


def test_a_head_budget_run_reports_the_exported_model(budget_run):
    out, metrics = budget_run
    report = json.loads((out / "pruned" / "export_report.json").read_text())
    assert metrics["model"] == "exported" and metrics["heads_alive"]["total"] == 5 == report["heads_kept"]["total"][0]
    assert metrics["params"] == report["params_after"] < metrics["params_before"]
    assert sum(len(kept) for kept in metrics["plan"].values()) == 5
    assert metrics["gated"]["heads_alive"]["total"] == 24  # the gated model under the binary rule: another model
    assert metrics["budget"]["total"]["target"] == 5 and metrics["budget"]["total"]["expected_open"] > 0
    # the number metrics.json reports is what gatedprune-evaluate finds in the export directory
    scores = evaluate_dir(out / "pruned", "validation", ["experiment=smoke"])
    assert round(scores["bleu"], 2) == round(metrics["bleu"], 2) and round(scores["chrf"], 2) == round(metrics["chrf"], 2)
    assert scores["loss"] == pytest.approx(metrics["val_loss"], rel=1e-5)
    test = evaluate_dir(out / "pruned", "test", ["experiment=smoke"])
    assert round(test["chrf"], 2) == round(metrics["test"]["pruned"]["chrf"], 2)


def test_the_test_split_is_scored_for_the_dense_and_the_exported_model(budget_run):
    _, metrics = budget_run
    dense, pruned = metrics["test"]["dense"], metrics["test"]["pruned"]
    assert dense["step"] == 10 and dense["sentences"] == pruned["sentences"] == 40
    assert dense["decoding"] == pruned["decoding"] == {"num_beams": 1, "max_new_tokens": 20, "length_factor": 1.5,
                                                        "batch_size": None, "extra": {}}
    for score in (dense, pruned):
        assert 0 <= score["bleu"] <= 100 and 0 <= score["chrf"] <= 100 and score["sentences_per_s"] > 0
        assert score["sacrebleu_signature"]["bleu"].startswith("nrefs:1|")


def test_files_with_and_without_a_test_split(tmp_path, pairs):
    files = {split: str(_write_tsv(tmp_path / f"{split}.tsv", part))
             for split, part in (("train", pairs[:200]), ("validation", pairs[200:240]), ("test", pairs[240:280]))}
    common = ["data=files", f"data.files.train={files['train']}", f"data.files.validation={files['validation']}",
              "trainer.max_steps=12"]
    metrics = train(compose_train(tmp_path / "with", "experiment=smoke", *common, f"data.files.test={files['test']}"))
    assert set(metrics["test"]) == {"dense", "pruned"} and metrics["test"]["pruned"]["sentences"] == 40
    metrics = train(compose_train(tmp_path / "without", "experiment=smoke", *common, "export.enabled=false"))
    assert metrics["test"] == {"note": "no test split: the data source was given none"}
    assert metrics["model"] == "gated (pruning.eval_gate_mode=binary)"


def test_a_budget_ramp_longer_than_the_gated_phase_is_shortened_and_said(budget_run, capsys, tmp_path):
    from gatedprune.methods.gated import L0Budget

    method = L0Budget(start_step=10, target_heads=5, target_warmup_steps=100)
    method.check_schedule(30)
    assert method.target_warmup_steps == 10
    assert ("pruning.target_warmup_steps=100 is longer than the gated phase (20 steps: trainer.max_steps=30 - "
            "pruning.start_step=10); the target ramps over 10 steps instead") in capsys.readouterr().out
    dense_only = L0Budget(start_step=10)
    dense_only.check_schedule(10)  # the dense phase alone: a dense run, which may not export
    with pytest.raises(ValueError, match=r"with no gated step \(trainer.max_steps=10, pruning.start_step=10\) has "
                                         "nothing to export; allowed: .* or export.enabled=false"):
        dense_only.check_outputs(SimpleNamespace(enabled=True), None, tmp_path)
    _, metrics = budget_run  # smoke: 20 gated steps, the default ramp of 100 shortened to 10
    assert metrics["budget"]["total"]["target"] == 5


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory, pairs):
    """A tiny mBART saved with save_pretrained, with its own tokenizer: not pruned, not gatedprune's."""
    path = tmp_path_factory.mktemp("plain") / "model"
    save_plain_mbart(path, train_unigram_tokenizer([t for pair in pairs for t in pair], 300), width=32)
    return path


def test_evaluate_scores_a_plain_model_against_an_independent_reference(plain_model, tmp_path, pairs):
    test_file = _write_tsv(tmp_path / "test.tsv", pairs[:12])
    overrides = ["data=files", f"data.files.test={test_file}"]  # the splits it does not score need not be given
    # one sentence a batch: no padding, so the reference below must match exactly
    assert main([str(plain_model), *overrides, "--out", str(tmp_path / "eval.json"), "--batch-size", "1"]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    # reference: this test's own loop, one sentence at a time, greedy, the same length cap
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(plain_model).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain_model)
    hyps = []
    for source, _ in pairs[:12]:
        ids = tokenizer(source, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, num_beams=1, do_sample=False, max_new_tokens=min(96, int(1.5 * ids.shape[1]) + 10))
        hyps.append(tokenizer.decode(out[0], skip_special_tokens=True))
    refs = [t for _, t in pairs[:12]]
    assert result["sentences"] == 12 and result["decoding"]["batch_size"] == 1 and result["split"] == "test"
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)


def test_evaluate_refuses_bad_input_in_one_line(plain_model, tmp_path):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50, bos_token_id=0,
                                                         eos_token_id=0)).save_pretrained(gpt2)
    cases = [
        ([str(tmp_path / "nothing")], "is neither a model directory nor a cached hub model"),
        ([str(tmp_path)], "is not a model directory (no config.json)"),
        ([str(plain_model), "--split", "dev"], "--split 'dev'; allowed: train, validation, test"),
        ([str(plain_model), "data=files", "data.files.train=null", "data.files.validation=null"],
         "has no entry for split 'test'"),
        ([str(plain_model), "data.tgt_lang=de", "data=files", f"data.files.test={tmp_path / 'x.jsonl'}",
          "data.files.train=null", "data.files.validation=null"], "data file not found"),
    ]
    for args, says in cases:
        proc = subprocess.run([sys.executable, "-m", "gatedprune", "evaluate", *args], capture_output=True, text=True,
                              env=offline_env(), cwd=tmp_path, timeout=300)
        assert proc.returncode == 2 and says in error_line(proc), (args, proc.stderr[-2000:])
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "evaluate", str(gpt2)], capture_output=True, text=True,
                          env=offline_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "not a sequence-to-sequence" in error_line(proc), proc.stderr[-2000:]
