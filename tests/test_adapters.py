"""The attention layout is found by structure: layouts and variants of real classes, refusals, a pinned layout."""

import copy

import pytest
import torch
import transformers

from gatedprune.structures.adapters import attention_sites, pin_layout, probe
from gatedprune.reports.support import build_tiny
from gatedprune.surgery.cut import grouped_slots


@pytest.mark.parametrize(
    ("cls", "layout", "bias", "grouped"),
    [
        (transformers.BartForConditionalGeneration, "bart-like", None, False),
        (transformers.WhisperForConditionalGeneration, "bart-like", None, False),
        (transformers.T5ForConditionalGeneration, "t5-like", "shared", False),
        (transformers.UMT5ForConditionalGeneration, "t5-like", "per-layer", False),
        (transformers.T5GemmaForConditionalGeneration, "llama-like", None, True),
    ],
)
def test_probe_finds_layout_and_variants(cls, layout, bias, grouped):
    model = build_tiny(cls)
    structure = probe(model)
    assert {stack: layout.name for stack, layout in structure.layouts.items()} == {"encoder": layout, "decoder": layout}
    assert (structure.position_bias, structure.grouped) == ({"encoder": bias, "decoder": bias}, grouped)
    sites = attention_sites(model)
    assert [s.kind for s in sites] == ["encoder"] * 2 + ["decoder"] * 2 + ["cross"] * 2
    assert all(s.num_heads == 4 and s.num_kv_heads == (2 if grouped else 4) for s in sites)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (transformers.LongT5ForConditionalGeneration,
         r"decoder decoder.block matches, but no encoder layers do .*attention outside them: "
         r"LongT5LocalAttention\(q, k, v, o\) at encoder.block.0.layer.0.LocalSelfAttention"),
        (transformers.Qwen2AudioForConditionalGeneration,
         r"no decoder layers with cross-attention .*self-attention stacks found: \['model.audio_tower.layers', "
         r"'model.language_model.layers'\]"),
    ],
)
def test_models_no_layout_describes_are_refused_with_what_was_found(cls, message):
    with pytest.raises(ValueError, match=message):
        attention_sites(build_tiny(cls))


def test_two_encoder_stacks_are_refused_until_one_is_pinned():
    model = build_tiny(transformers.BartForConditionalGeneration)
    model.model.extra = copy.deepcopy(model.model.encoder.layers)  # a second stack of self-attention layers
    with pytest.raises(ValueError, match=r"encoder-like stacks \['model.encoder.layers', 'model.extra'\] and decoder "
                                         r"stacks \['model.decoder.layers'\]: not one of each"):
        probe(model)
    pin_layout(model, {"base": "bart-like", "encoder_layers": "model.encoder.layers"})
    assert attention_sites(model, "encoder")[1].path == "model.encoder.layers.1.self_attn"
    assert model.config.gatedprune_layout["encoder_layers"] == "model.encoder.layers"


def test_a_pin_that_does_not_fit_is_refused():
    model = build_tiny(transformers.BartForConditionalGeneration)
    with pytest.raises(ValueError, match="needs base .*got 'gpt'"):
        pin_layout(model, "gpt")
    with pytest.raises(ValueError, match=r"unknown keys \['heads'\]"):
        pin_layout(model, {"base": "bart-like", "heads": 3})
    with pytest.raises(ValueError, match=r"no decoder layers with cross-attention \(layouts: t5-like \(pinned\)\)"):
        pin_layout(model, "t5-like")


@pytest.mark.parametrize(
    ("kept", "slots", "kv", "fillers"),
    [
        ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1], []),
        ([1, 2, 3], [0, 1, 2, 3], [0, 1], [0]),  # group 0 keeps one of two: head 0 fills in, output zeroed
        ([3], [3], [1], []),  # k/v head 0 goes: none of its query heads stays
        ([0, 3], [0, 3], [0, 1], []),
        ([], [], [], []),
    ],
)
def test_grouped_slots(kept, slots, kv, fillers):
    assert grouped_slots(kept, [0, 1, 2, 3], group=2) == (slots, kv, fillers)


def test_grouped_surgery_records_slots_and_key_value_heads():
    from gatedprune.surgery.cut import count_parameters, plan_record, prune_heads

    model = build_tiny(transformers.T5GemmaForConditionalGeneration)
    site = attention_sites(model, "cross")[0]
    before = count_parameters(model)
    prune_heads(model, {site.path: [3]})
    record = plan_record(model)
    assert record["kept_heads"]["cross"][site.path] == [3]
    assert (record["slots"][site.path], record["kv_heads"][site.path]) == ([3], [1])
    module = model.get_submodule(site.path)
    assert (module.q_proj.out_features, module.k_proj.out_features, module.num_key_value_groups) == (8, 8, 1)
    d, width = 8, model.config.decoder.hidden_size
    assert before - count_parameters(model) == 3 * d * (width + width) + 1 * d * 2 * module.k_proj.in_features
    prune_heads(model, {site.path: []})
    assert module.q_proj.out_features == 0 and module.num_key_value_groups == 1
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6]]), decoder_input_ids=torch.tensor([[0, 7]]))


def test_model_card_of_a_grouped_model_says_what_went(tmp_path):
    from gatedprune.shipping.export import save_pruned
    from gatedprune.surgery.model_loading import load_pruned
    from gatedprune.surgery.cut import prune_heads

    model = build_tiny(transformers.T5GemmaForConditionalGeneration)
    sites = attention_sites(model)
    prune_heads(model, {sites[0].path: [1, 2, 3], sites[-1].path: [3]})
    report = save_pruned(model, tmp_path / "out")
    assert report["kv_heads_kept"] == [11, 12] and report["filler_heads"] == 1
    assert "11 of 12 key/value heads kept" in (tmp_path / "out" / "README.md").read_text()
    assert report["params_after"] == sum(p.numel() for p in load_pruned(tmp_path / "out").parameters())
