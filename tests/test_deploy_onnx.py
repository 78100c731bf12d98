"""``--format onnx``: the pruned model of every family, exported, decodes in ONNX Runtime to the tokens a PyTorch
greedy loop written here (no cache, no ``generate()``) gives; the edge shapes (heads of a whole module gone, no
encoder layer) export too; a failed check and a refused model leave no directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from families import FAMILY_CONFIGS

from gatedprune.deploy import onnx_export
from gatedprune.deploy.formats import convert
from gatedprune.deploy.onnx_greedy import CONFIG_FILE, OnnxSeq2Seq
from gatedprune.deploy.verify import DeployError
from gatedprune.shipping.export_inputs import sample_batch
from gatedprune.structures.adapters import probe
from gatedprune.structures.kinds import ALL_KINDS, LAYER_KINDS
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import prune_heads

STEPS = 8  # greedy tokens compared, EOS not stopping the loops: every step of the cache is checked
FORCED = 5  # a target-language code, forced first as M2M100/NLLB and mBART-50 do


def _tiny(family: str, decoder_layers: int = 2, seed: int = 0):
    """The family's tiny random model (2 + 2 layers, 4 heads), with ``decoder_layers`` decoder layers."""
    config = FAMILY_CONFIGS[family]()
    for field in ("decoder_layers", "num_decoder_layers"):  # whichever the family counts its decoder layers by
        if field in config.to_dict():
            setattr(config, field, decoder_layers)
    torch.manual_seed(seed)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


def _mixed_plan(model) -> dict:
    """Some heads and units of every module, unevenly (a module keeps units i with (i + layer + offset) % 3 != 0:
    2 or 3 of 4 heads), and decoder layer 0 dropped (T5: its position bias moves to layer 1). The decoder layer
    left keeps 3 self-attention and 2 cross-attention heads; the encoder layers keep 2 and 3."""
    offset = {"cross": 2}
    plan = {site.path: [i for i in range(site.num_units) if (i + site.layer + offset.get(site.kind, 0)) % 3]
            for site in structure_sites(model, [k for k in ALL_KINDS if k not in LAYER_KINDS])}
    plan[probe(model).layers["decoder"]] = [1]
    return plan


def _edge_plan(model) -> dict:
    """No encoder layer; decoder layer 0 without self-attention heads, layer 1 without cross-attention heads."""
    plan = {probe(model).layers["encoder"]: []}
    for site in structure_sites(model, ["decoder", "cross"]):
        if (site.kind, site.layer) in (("decoder", 0), ("cross", 1)):
            plan[site.path] = []
    return plan


@torch.no_grad()
def _pytorch_greedy(model, batch: dict, steps: int) -> torch.Tensor:
    """Greedy ids (B, steps): the whole prefix through the model at every step, no cache."""
    config, forced = model.config, model.generation_config.forced_bos_token_id
    decoder_ids = torch.full((len(batch["input_ids"]), 1), config.decoder_start_token_id)
    for step in range(steps):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=decoder_ids, use_cache=False).logits[:, -1]  # (B, V)
        token = logits.argmax(-1) if step or forced is None else torch.full_like(logits[:, 0], forced, dtype=torch.long)
        decoder_ids = torch.cat([decoder_ids, token[:, None]], 1)
    return decoder_ids[:, 1:]


def _until_eos(row, eos: int) -> list[int]:
    row = row.tolist()
    return row[: row.index(eos)] if eos in row else row


def _check_export(model, out, steps: int = STEPS) -> tuple[dict, OnnxSeq2Seq]:
    batch = sample_batch(model)  # what convert verifies on: random ids, the last row half padding
    report = convert(model, out, "onnx", max_new_tokens=steps)
    assert report["verification"]["passed"] and report["verification"]["steps_compared"] == steps
    runtime = OnnxSeq2Seq(out, threads=1)
    want = _pytorch_greedy(model, batch, steps)
    got = runtime.generate(batch["input_ids"].numpy(), batch["attention_mask"].numpy(), steps, stop_at_eos=False)
    assert torch.equal(torch.from_numpy(got), want)  # every step, past EOS too
    sources = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert runtime.greedy(sources, steps) == [_until_eos(row, model.config.eos_token_id) for row in want]
    return report, runtime


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family)``: the family's pruned model (mixed plan), its plan and report, exported once per module
    (the failure tests reuse Marian's graphs instead of exporting again)."""
    built = {}

    def get(family: str):
        if family not in built:
            model = _tiny(family)
            if family in ("m2m_100", "mbart"):
                model.generation_config.forced_bos_token_id = FORCED
            plan = _mixed_plan(model)
            prune_heads(model, plan)
            out = tmp_path_factory.mktemp(family) / "out"
            built[family] = (model, plan, out, _check_export(model, out)[0])
        return built[family]

    return get


@pytest.mark.parametrize("family", onnx_export.FAMILIES)
def test_a_pruned_model_decodes_in_onnxruntime_as_in_pytorch(exported, family):
    model, plan, out, report = exported(family)  # checked against the PyTorch greedy loop (_check_export)
    sites = {(s.kind, s.layer): s.path for s in structure_sites(_tiny(family), ["decoder", "cross"])}
    # the caches the loop feeds have the heads the plan kept in the decoder layer left (original layer 1)
    assert [[layer["self_attention"]["heads"], layer["cross_attention"]["heads"]] for layer in report["layers"]] == \
        [[len(plan[sites[("decoder", 1)]]), len(plan[sites[("cross", 1)]])]] == [[3, 2]]
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["tokens"]["forced_first"] == (FORCED if family in ("m2m_100", "mbart") else None)
    assert config["tokens"]["decoder_start"] == model.config.decoder_start_token_id  # Marian: pad; mBART: EOS
    assert set(report["files"]) >= {"encoder.onnx", "decoder_step.onnx", CONFIG_FILE}


@pytest.mark.parametrize("batch_size, length", [(1, 40), (5, 3)])
def test_the_graphs_take_other_batch_sizes_and_lengths_than_they_were_traced_and_verified_at(exported, batch_size,
                                                                                            length):
    """Batch 1 with a 40-token source, batch 5 of 3 tokens with a padded row: the graphs' batch, source and cache
    lengths are symbolic, so the loop gives the PyTorch loop's tokens there too."""
    model, _, out, _ = exported("t5")
    generator = torch.Generator().manual_seed(batch_size)
    input_ids = torch.randint(2, model.config.vocab_size, (batch_size, length), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[-1, length // 2:] = 0 if batch_size > 1 else 1
    got = OnnxSeq2Seq(out, threads=1).generate(input_ids.numpy(), mask.numpy(), STEPS, stop_at_eos=False)
    want = _pytorch_greedy(model, {"input_ids": input_ids, "attention_mask": mask}, STEPS)
    assert torch.equal(torch.from_numpy(got), want)


def test_edge_shapes_export_modules_without_heads_and_no_encoder_layer(tmp_path):
    model = _tiny("t5", decoder_layers=3)  # the shared position bias, handed past a layer without heads
    prune_heads(model, _edge_plan(model))
    assert len(model.get_submodule(probe(model).layers["encoder"])) == 0
    report, _ = _check_export(model, tmp_path / "out")
    heads = [[layer["self_attention"]["heads"], layer["cross_attention"]["heads"]] for layer in report["layers"]]
    assert heads == [[1, 4], [4, 1], [4, 4]]  # a module without heads keeps one phantom head of zeros


def test_the_loop_in_the_directory_runs_without_torch(exported):
    model, _, out, _ = exported("marian")
    sources = [[5, 6, 7, 2], [8, 9, 2]]  # Marian's EOS is 2
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from onnx_greedy import OnnxSeq2Seq; "
            "print(json.dumps(OnnxSeq2Seq(sys.argv[1], threads=1).greedy(json.loads(sys.argv[2]), 6))); "
            "assert 'torch' not in sys.modules and 'gatedprune' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", code, str(out), json.dumps(sources)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    padded = torch.tensor([ids + [model.config.pad_token_id] * (4 - len(ids)) for ids in sources])
    batch = {"input_ids": padded, "attention_mask": (torch.arange(4) < torch.tensor([[4], [3]])).long()}
    want = [_until_eos(row, model.config.eos_token_id) for row in _pytorch_greedy(model, batch, 6)]
    assert json.loads(run.stdout) == want


@pytest.mark.parametrize("wrong", ["tokens", "logits"])
def test_a_failed_check_raises_and_leaves_no_directory(exported, wrong, tmp_path, monkeypatch):
    model, _, graphs, _ = exported("marian")

    def copy_export(model, stage):  # the graphs already written, to save exporting them again
        shutil.copytree(graphs, stage, dirs_exist_ok=True)
        return json.loads((stage / CONFIG_FILE).read_text())

    step = OnnxSeq2Seq.step

    def wrong_step(self, feeds):
        logits, caches = step(self, feeds)
        if wrong == "tokens":
            logits[:, 3] = logits.max() + 1  # token 3 wins every step
        else:
            logits = logits + 1e-2  # the same tokens, logits off
        return logits, caches

    monkeypatch.setattr(onnx_export, "export", copy_export)
    monkeypatch.setattr(OnnxSeq2Seq, "step", wrong_step)
    message = {"tokens": r"greedy sequences differ .* onnxruntime \[3", "logits": r"logits differ by 0\.01"}[wrong]
    with pytest.raises(DeployError, match=message) as failure:
        convert(model, tmp_path / "out", "onnx", max_new_tokens=STEPS)
    assert "\n" not in str(failure.value)
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its staging sibling


@pytest.mark.parametrize("case", ["pegasus", "int8"])
def test_a_refused_model_is_one_line_and_no_directory(model_of, case, tmp_path):
    model = model_of("pegasus" if case == "pegasus" else "bart")
    options = {"quantization": "int8"} if case == "int8" else {}
    match = {"pegasus": r"--format onnx covers bart, .*; this model is pegasus", "int8": r"--quantization int8"}[case]
    with pytest.raises(ValueError, match=match) as refusal:
        convert(model, tmp_path / "out", "onnx", **options)
    assert "\n" not in str(refusal.value)
    assert list(tmp_path.iterdir()) == []
