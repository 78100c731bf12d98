"""``--format ct2``: pruned models of every family CTranslate2 covers, converted, loaded in CTranslate2 and compared
here with the PyTorch model's own greedy tokens and reference log-probabilities, computed in the test."""

from __future__ import annotations

import json

import pytest
import torch

from gatedprune.deploy import formats
from gatedprune.deploy.verify import DeployError
from gatedprune.structures.adapters import probe
from gatedprune.structures.kinds import ALL_KINDS, LAYER_KINDS
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import prune_heads

ctranslate2 = pytest.importorskip("ctranslate2")  # the deploy extra; make test installs it, so CI runs these

CT2_FAMILIES = ("bart", "mbart", "marian", "m2m_100", "t5", "mt5")
MAX_NEW = 10


def _talkative(model):
    """An untrained model says EOS at once; with EOS's output row zeroed (its logit 0, others spread around 0) it
    says more, so the comparisons cover several decoding steps. A final logits bias (BART-likes) is made non-zero,
    so its mapping is compared too."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.eos_token_id] = 0
        bias = getattr(model, "final_logits_bias", None)
        if bias is not None:
            bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))
            bias[..., model.config.eos_token_id] = -1.0
    return model


def _batch(model, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab - 1, (3, 9), generator=generator)  # (B, S)
    input_ids[:, -1] = model.config.eos_token_id
    mask = torch.ones_like(input_ids)
    mask[-1, 5:] = 0  # a padded row
    input_ids[-1, 5:] = model.config.pad_token_id
    labels = torch.randint(3, vocab - 1, (3, 6), generator=generator)
    labels[:, -1] = model.config.eos_token_id
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _mixed_plan(model) -> dict:
    """Uneven heads per layer (and self != cross counts), some FFN units, the last decoder layer gone."""
    plan = {s.path: [i for i in range(s.num_units) if (i + s.layer + (s.kind == "cross")) % 3]
            for s in structure_sites(model, [k for k in ALL_KINDS if k not in LAYER_KINDS])}
    plan[probe(model).layers["decoder"]] = [0]
    return plan


def _ct2_greedy(directory, model, batch) -> list[list[int]]:
    """CTranslate2's greedy ids, read here with the vocabulary file the export wrote."""
    tokens = json.loads((directory / "shared_vocabulary.json").read_text())
    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type="float32")
    index = {t: i for i, t in enumerate(tokens)}
    sources = [[tokens[i] for i in row[mask.bool()].tolist()]
               for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=MAX_NEW, min_decoding_length=0)
    return [[index[t] for t in r.hypotheses[0]] for r in results]


def _pytorch_greedy(model, batch) -> list[list[int]]:
    """A plain greedy loop over the PyTorch model's full forward (no cache, no generation config)."""
    eos, out = model.config.eos_token_id, []
    with torch.no_grad():
        for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
            source = row[mask.bool()][None]  # (1, S)
            start = model.generation_config.decoder_start_token_id
            target = [model.config.decoder_start_token_id if start is None else start]
            for _ in range(MAX_NEW):
                nxt = int(model(input_ids=source, decoder_input_ids=torch.tensor([target])).logits[0, -1].argmax())
                if nxt == eos:
                    break
                target.append(nxt)
            out.append(target[1:])
    return out


@pytest.mark.parametrize("family", CT2_FAMILIES)
def test_a_pruned_model_of_every_family_gives_pytorchs_greedy_tokens_in_ctranslate2(model_of, family, tmp_path):
    model = _talkative(model_of(family))
    prune_heads(model, _mixed_plan(model))
    batch = _batch(model)
    report = formats.convert(model, tmp_path / "ct2", "ct2", batch=batch, max_new_tokens=MAX_NEW)
    expected = _pytorch_greedy(model, batch)
    assert max(len(t) for t in expected) > 2  # several steps compared, not only a first EOS
    assert _ct2_greedy(tmp_path / "ct2", model, batch) == expected
    check = report["verification"]
    assert check["passed"] and check["scored"] == "references"
    assert check["max_abs_logprob_diff"] < 1e-5  # exact up to float32 summation order (the tolerance is 1e-4)
    # uneven heads padded to each stack's largest count; the report counts the padding slots
    attention = structure_sites(model, ["encoder", "decoder", "cross"])
    for stack, kinds in (("encoder", ("encoder",)), ("decoder", ("decoder", "cross"))):
        counts = [s.num_heads for s in attention if s.kind in kinds]
        assert report["heads"][stack] == max(counts)
        assert report["padded_head_slots"][stack] == sum(max(counts) - c for c in counts)
    assert report["padded_head_slots"]["decoder"] > 0


def test_a_uniform_plan_with_equal_self_and_cross_counts_needs_no_padding(model_of, tmp_path):
    """What pruning.uniform_heads ships (one count per layer and kind; here also self = cross): no padding slots."""
    model = _talkative(model_of("t5"))
    plan = {s.path: [i for i in range(s.num_units) if i % 2 == s.layer % 2]  # 2 of 4 heads, other ones per layer
            for s in structure_sites(model, ["encoder", "decoder", "cross"])}
    prune_heads(model, plan)
    batch = _batch(model)
    report = formats.convert(model, tmp_path / "ct2", "ct2", batch=batch, max_new_tokens=MAX_NEW)
    assert report["heads"] == {"encoder": 2, "decoder": 2}
    assert report["padded_head_slots"] == {"encoder": 0, "decoder": 0}
    assert _ct2_greedy(tmp_path / "ct2", model, batch) == _pytorch_greedy(model, batch)


@pytest.mark.parametrize("family", ["mbart", "t5"])
def test_edge_plans_every_cross_head_and_unit_of_a_layer_and_every_encoder_layer(model_of, family, tmp_path):
    model = _talkative(model_of(family))
    plan = {s.path: [] for s in structure_sites(model, ["cross", "decoder_ffn"]) if s.layer == 0}
    plan[probe(model).layers["encoder"]] = []
    prune_heads(model, plan)
    batch = _batch(model)
    report = formats.convert(model, tmp_path / "ct2", "ct2", batch=batch, max_new_tokens=MAX_NEW)
    assert report["padded_ffn_layers"] == {"encoder": 0, "decoder": 1}
    assert _ct2_greedy(tmp_path / "ct2", model, batch) == _pytorch_greedy(model, batch)


def test_int8_loads_and_translates(model_of, tmp_path):
    model = _talkative(model_of("mbart"))
    prune_heads(model, _mixed_plan(model))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    report = formats.convert(model, tmp_path / "ct2", "ct2", batch=_batch(model), max_new_tokens=MAX_NEW,
                             quantization="int8")
    # quantizing the spec in place must not reach the model it was built from
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert report["quantization"] == "int8" and report["quantized"]["translated"] == 3
    assert report["quantized"]["compute_type"].startswith("int8")  # run as saved, not as float32
    assert not (tmp_path / "ct2" / ".float32").exists()
    int8_size = (tmp_path / "ct2" / "model.bin").stat().st_size
    formats.convert(model, tmp_path / "f32", "ct2", batch=_batch(model), max_new_tokens=MAX_NEW)
    assert int8_size < (tmp_path / "f32" / "model.bin").stat().st_size  # int8 weights are smaller


def test_a_conversion_that_does_not_match_writes_nothing(model_of, tmp_path, monkeypatch):
    from gatedprune.deploy import ct2_spec

    model = _talkative(model_of("mbart"))
    real = ct2_spec._ffn

    def wrong(spec, site):  # a bug in the mapping: one FFN's output doubled
        real(spec, site)
        spec.linear_1.weight = spec.linear_1.weight * 2

    monkeypatch.setattr(ct2_spec, "_ffn", wrong)
    with pytest.raises(DeployError, match="CTranslate2 float32 does not give the PyTorch model's outputs"):
        formats.convert(model, tmp_path / "ct2", "ct2", batch=_batch(model), max_new_tokens=MAX_NEW)
    assert not (tmp_path / "ct2").exists() and not list(tmp_path.iterdir())


def test_refusals_are_one_line_and_leave_no_directory(model_of, tmp_path, monkeypatch):
    cases = {
        "pegasus": (model_of("pegasus"), {}, "--format ct2 covers bart, mbart, marian, m2m_100, t5, mt5; this model is pegasus"),
        "quantization": (model_of("mbart"), {"quantization": "int3"}, "--quantization int3 is not one of CTranslate2's"),
    }
    bart = model_of("bart")
    prune_heads(bart, {probe(bart).layers["encoder"]: []})
    cases["post-norm, no encoder"] = (bart, {}, "has no encoder layer left, and CTranslate2 needs one")
    for name, (model, options, message) in cases.items():
        with pytest.raises(ValueError) as err:
            formats.convert(model, tmp_path / name, "ct2", **options)
        assert message in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / name).exists()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"--format ct2 needs ctranslate2, not installed; install the extra: "
                                         r"pip install 'gatedprune\[deploy\]'"):
        formats.convert(model_of("mbart"), tmp_path / "missing", "ct2")
    assert not (tmp_path / "missing").exists()
