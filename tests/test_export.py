"""The exporter: verified, self-describing output directories, both loading paths, atomic writes, the CLI."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import logging
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import gatedprune.shipping.export as export
import gatedprune.shipping.export_dir as export_dir
from gatedprune.surgery import pruned_modeling
from gatedprune.cli import export_command
from families import FAMILIES
from gatedprune.structures.adapters import attention_sites
from gatedprune.structures.head_gates import attach_gates
from gatedprune.surgery.model_loading import load_pruned
from gatedprune.structures.masking import masked_heads
from gatedprune.surgery.cut import plan_record, prune_heads

transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)  # tiny matrices: extra threads only wait on each other on a busy 2-core box

WORDS = "the a cat dog sat ran on under mat house red blue".split()


def gated(model, kinds=("encoder", "decoder", "cross")):
    """Gates with a mix of open, closed and undecided heads, and one attention module fully closed."""
    gates = attach_gates(model, kinds)
    with torch.no_grad():
        for i, gate in enumerate(gates.gates):
            gate.log_alpha.copy_(torch.tensor([4.0, -4.0, 0.5, -0.2]).roll(i))
        gates.gates[1].log_alpha.fill_(-5.0)
    return gates


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


@torch.no_grad()
def logits(model, batch) -> torch.Tensor:
    return model(**batch).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_a_verified_directory_that_reloads_both_ways(model_of, family, tmp_path):
    model = model_of(family)
    gates = gated(model)
    out = tmp_path / "out"
    report = export.export_gated(model, gates, out)

    check = report["verification"]
    assert check["passed"] and check["greedy_identical"] and check["params_match"]
    assert check["max_abs_logit_diff"] < 1e-4
    assert set(check["reload_max_abs_logit_diff"]) == {"load_pruned", "trust_remote_code"}
    assert report["params_after"] < report["params_before"]
    assert report["file_size_after"] < report["file_size_before"] and report["file_size_before_measured"]
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", export.REPORT_FILE, "generation_config.json", "model.safetensors",
        export.MODELING_FILE,
    ]
    assert not list(tmp_path.glob(".out.*"))

    config = json.loads((out / "config.json").read_text())
    assert config["gatedprune"]["rule"] == "binary"
    assert config["gatedprune"]["kept_heads"] == {
        kind: {path: kept for path, kept in gates.plan().items() if path in per_kind}
        for kind, per_kind in config["gatedprune"]["kept_heads"].items()
    }

    # the caller's gated model is untouched, and both loading paths give the function of the gated model
    batch = export.sample_batch(model)
    gates.remove()
    with masked_heads(model, gates.plan()):
        expected = logits(model, batch)
    by_gatedprune = load_pruned(out)
    by_transformers = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)
    assert type(by_gatedprune) is type(model)
    assert type(by_transformers).__name__ == f"GatedPruned{type(model).__name__}"
    for loaded in (by_gatedprune, by_transformers):
        torch.testing.assert_close(logits(loaded, batch), expected, rtol=0, atol=1e-5)
        assert sum(p.numel() for p in loaded.parameters()) == report["params_after"]

    card = (out / "README.md").read_text()
    first = attention_sites(model)[0]
    assert f"| {first.layer} | " in card and "cross-attention" in card
    assert f"{report['params_before']:,}" in card and f"{report['params_after']:,}" in card
    assert "max |logit difference|" in card and "trust_remote_code" in card


def test_modeling_file_imports_only_torch_and_transformers():
    tree = ast.parse(open(pruned_modeling.__file__).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"torch", "transformers"}


def test_top_k_rule_keeps_exactly_k_heads(model_of, tmp_path):
    model = model_of("t5")
    gates = gated(model, ("encoder", "cross"))
    report = export.export_gated(model, gates, tmp_path / "out", rule="top-k", top_k=5)
    assert report["verification"]["passed"]
    assert report["rule"] == "top-k, k=5"
    kept = report["heads_kept"]
    assert kept["encoder"][0] + kept["cross"][0] == 5 and kept["decoder"] == [8, 8]
    assert kept["total"] == [13, 24]


def test_gate_rules_make_plans(model_of):
    gates = gated(model_of("bart"))
    assert gates.plan("binary") == {p: [h for h in range(g.num_heads) if g.log_alpha[h] > 0]
                                    for p, g in zip(gates.paths, gates.gates)}
    top = gates.plan("top-k", 3)
    assert sum(map(len, top.values())) == 3
    log_alpha = dict(zip(gates.paths, (gate.log_alpha.detach() for gate in gates.gates)))
    assert all(float(log_alpha[path][head]) == 4.0 for path, heads in top.items() for head in heads)
    with pytest.raises(ValueError, match="top_k"):
        gates.plan("top-k", gates.num_heads + 1)
    with pytest.raises(ValueError, match="only used by rule='top-k'"):
        gates.plan("binary", 3)
    with pytest.raises(ValueError, match="unknown gate rule"):
        gates.plan("magnitude")


def test_warns_about_unconverged_gates_and_says_what_the_rule_removes(model_of, tmp_path, caplog):
    model = model_of("marian")
    gates = gated(model)
    with caplog.at_level(logging.INFO, logger="gatedprune.export"):
        report = export.export_gated(model, gates, tmp_path / "out")
    # per module: 0.5 and -0.2 give deterministic gates strictly inside (0, 1); the closed module adds none
    assert report["unconverged_gates"] == 2 * (len(gates.gates) - 1)
    assert f"gates have not converged: {report['unconverged_gates']} of 24" in caplog.text
    assert "rule binary keeps total 10/24, encoder " in caplog.text  # heads kept of those gated


def test_refuses_a_non_empty_output_directory_unless_told_to_overwrite(model_of, tmp_path):
    model = model_of("bart")
    gates = gated(model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export.export_gated(model, gates, out)
    assert (out / "keep.txt").read_text() == "mine"
    export.export_gated(model, gates, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    empty = tmp_path / "empty"
    empty.mkdir()
    export.export_gated(model, gates, empty)
    assert (empty / "config.json").exists()


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_an_interrupted_export_leaves_no_partial_output(model_of, tmp_path, monkeypatch, interruption):
    def interrupted(*args, **kwargs):
        raise interruption("interrupted while writing the model card")

    monkeypatch.setattr(export_dir, "write_card", interrupted)
    model = model_of("mbart")
    with pytest.raises(interruption):
        export.export_gated(model, gated(model), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_pruned_model_that_computes_something_else_fails_with_the_numbers(model_of, tmp_path, monkeypatch):
    def prune_wrongly(model, plan, rule=None):
        prune_heads(model, plan, rule)
        with torch.no_grad():
            bias = attention_sites(model)[0].projection("o").bias
            bias.add_(torch.linspace(0, 1, len(bias)))  # not a constant shift: layer norms would remove that

    monkeypatch.setattr(export, "prune_heads", prune_wrongly)
    model = model_of("pegasus")
    with pytest.raises(export.ExportError, match=r"max \|logit diff\| gated vs pruned 0\.\d+"):
        export.export_gated(model, gated(model), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_save_pruned_writes_a_loadable_directory_with_tokenizer(model_of, tmp_path):
    model = model_of("marian")
    prune_heads(model, {s.path: [0] for s in attention_sites(model, "decoder")}, rule="hand-written")
    report = export.save_pruned(model, tmp_path / "out", tokenizer())
    out = tmp_path / "out"
    assert (out / "tokenizer.json").exists() and (out / export.MODELING_FILE).exists()
    assert report["heads_kept"]["decoder"] == [2, 8] and not report["file_size_before_measured"]
    assert "Not verified" in (out / "README.md").read_text()
    loaded = load_pruned(out)
    assert plan_record(loaded)["kept_heads"] == plan_record(model)["kept_heads"]
    assert transformers.AutoTokenizer.from_pretrained(out)("the cat").input_ids == tokenizer()("the cat").input_ids


EXPORTER_KEYS = ("source_model", "versions")  # added to the record in config.json, not to the model's own


def _list_copies(monkeypatch, obj) -> int:
    """How many lists ``copy.deepcopy(obj)`` copies one by one."""
    count, plain = [0], copy._deepcopy_dispatch[list]

    def counted(x, memo, deepcopy=copy.deepcopy):
        count[0] += 1
        return plain(x, memo, deepcopy)

    monkeypatch.setitem(copy._deepcopy_dispatch, list, counted)
    copy.deepcopy(obj)
    monkeypatch.setitem(copy._deepcopy_dispatch, list, plain)
    return count[0]


def test_a_pruned_model_s_config_copies_its_plan_whole_and_truly(model_of, tmp_path, monkeypatch):
    # generate() deep-copies a flat encoder-decoder config several times a call: walked list by list, the plan's kept
    # indices slowed a batch-1 generate() of the teacher's shapes by 6-13% (docs/recovery.md)
    model = model_of("bart")
    prune_heads(model, {s.path: [0] for s in attention_sites(model, "decoder")}, rule="hand-written")
    export.save_pruned(model, tmp_path / "out", tokenizer())
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["gatedprune"]
    by_transformers = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    for pruned in (model, load_pruned(tmp_path / "out"), by_transformers):
        config = pruned.config
        without = copy.deepcopy(config)
        delattr(without, "gatedprune")
        assert _list_copies(monkeypatch, config) == _list_copies(monkeypatch, without)
        copied = copy.deepcopy(config).gatedprune
        assert copied == plan_record(pruned)
        assert {k: v for k, v in copied.items() if k not in EXPORTER_KEYS} == {
            k: v for k, v in saved.items() if k not in EXPORTER_KEYS}
        first = next(iter(copied["kept_units"]["decoder_ffn"]))
        copied["kept_units"]["decoder_ffn"][first].append(-1)  # a true copy: the model's own record is untouched
        assert plan_record(pruned)["kept_units"]["decoder_ffn"][first][-1] != -1
        assert config.to_dict()["gatedprune"] == plan_record(pruned)


def test_save_pruned_refuses_a_model_that_was_not_pruned(model_of, tmp_path):
    with pytest.raises(ValueError, match="never pruned"):
        export.save_pruned(model_of("bart"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def write_run(model, gates, run_dir, kinds):
    """A run directory as the trainer leaves it: checkpoint, metrics.json, tokenizer/, val_pairs.jsonl."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state |= {f"gates.{k}": v for k, v in gates.state_dict().items()}
    checkpoint = {
        "state_dict": state, "hf_config": model.config.to_dict(),
        "gate_options": dataclasses.asdict(gates.options), "gate_kinds": list(kinds),
    }
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, run_dir / "checkpoints" / "last.ckpt")
    (run_dir / "metrics.json").write_text(json.dumps({"checkpoint": "checkpoints/last.ckpt", "bleu": 1.0}))
    tokenizer().save_pretrained(run_dir / "tokenizer")
    pairs = [{"source": "the cat sat on the mat", "target": "a dog ran"}, {"source": "red house", "target": "blue"}]
    (run_dir / "val_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))


def test_cli_exports_a_run_directory_and_a_checkpoint(model_of, tmp_path, capsys):
    model = model_of("bart")
    kinds = ("encoder", "cross")
    gates = gated(model, kinds)
    write_run(model, gates, tmp_path / "run", kinds)

    assert export_command([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / export.REPORT_FILE).read_text())
    assert report["verification"]["passed"] and report["verification"]["inputs"] == "2 validation samples"
    assert report["plan"]["encoder"] == {p: k for p, k in gates.plan().items() if p.startswith("model.encoder.")}
    assert (tmp_path / "out" / "tokenizer.json").exists()

    assert export_command([str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert export_command([str(checkpoint), str(tmp_path / "top"), "--top-k", "4"]) == 0
    report = json.loads((tmp_path / "top" / export.REPORT_FILE).read_text())
    assert report["heads_kept"]["total"] == [4 + 8, 24] and report["rule"] == "top-k, k=4"
