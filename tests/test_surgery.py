"""prune_heads: the pruned model computes what the masked (gated, gates fixed) model computes, on every family."""

from __future__ import annotations


import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from families import FAMILIES
from gatedprune.structures.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.masking import masked_heads
from gatedprune.surgery.cut import check_plan, count_parameters, plan_record, prune_heads, removed_parameters
from gatedprune.surgery.model_loading import load_pruned

transformers.utils.logging.disable_progress_bar()


def inputs(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size - 2, (2, 7), generator=generator)  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    decoder_input_ids = torch.randint(3, model.config.vocab_size - 2, (2, 5), generator=generator)  # (B, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(**inputs(model)).logits


@torch.no_grad()
def greedy(model) -> torch.Tensor:
    batch = inputs(model)
    return model.generate(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6, do_sample=False,
        num_beams=1,
    )


def check_equivalent(model, plan, generate: bool = True):
    """Prune ``model`` by ``plan`` in place and compare with the masked model; returns the pruned model."""
    with masked_heads(model, plan):
        expected = logits(model)
        expected_tokens = greedy(model) if generate else None
    before, removed = count_parameters(model), removed_parameters(model, plan)
    prune_heads(model, plan)
    # float32 closeness (torch's defaults: atol 1e-5 plus rtol 1.3e-6 of the logit): the pruned projections sum
    # over fewer heads in another order, and an absolute bound alone failed by 1e-8 on an mT5 logit of 5.4
    torch.testing.assert_close(logits(model), expected, rtol=1.3e-6, atol=1e-5)
    if generate:
        assert torch.equal(greedy(model), expected_tokens)
    assert count_parameters(model) == before - removed
    return model


def heads_of(model, path: str) -> int:
    return next(site.num_heads for site in attention_sites(model) if site.path == path)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_empty_and_single_head_layers_of_one_kind(model_of, family, kind):
    model = model_of(family)
    sites = attention_sites(model, kind)
    plan = {sites[0].path: [], sites[1].path: [2]}
    check_equivalent(model, plan)
    assert [heads_of(model, s.path) for s in sites] == [0, 1]
    assert all(s.num_heads == 4 for s in attention_sites(model) if s.kind != kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_different_heads_per_layer_in_every_kind(model_of, family):
    """All kept, two, one and no heads, and different head sets per layer (T5: own columns of the shared bias)."""
    model = model_of(family)
    kept = {"encoder": ([0, 2], [1, 3]), "decoder": ([0, 1, 2, 3], [3]), "cross": ([1, 2], [])}
    plan = {s.path: kept[s.kind][s.layer] for s in attention_sites(model)}
    check_equivalent(model, plan)
    record = plan_record(model)
    assert record["kept_heads"]["encoder"][attention_sites(model, "encoder")[1].path] == [1, 3]
    assert set(record["num_heads"].values()) == {4}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_without_any_head_runs(model_of, family):
    model = model_of(family)
    check_equivalent(model, {s.path: [] for s in attention_sites(model)})
    assert all(s.num_heads == 0 for s in attention_sites(model))


@settings(max_examples=30, deadline=None)
@given(family=st.sampled_from(FAMILIES), data=st.data())
def test_random_plans(model_of, family, data):
    model = model_of(family)
    plan = {}
    for site in attention_sites(model):
        if data.draw(st.booleans(), label=f"prune {site.path}"):
            keep = data.draw(st.lists(st.booleans(), min_size=site.num_heads, max_size=site.num_heads))
            plan[site.path] = [head for head, kept in enumerate(keep) if kept]
    check_equivalent(model, plan)


@pytest.mark.parametrize("family", ["m2m_100", "t5"])
def test_beam_search_follows_the_pruned_cache(model_of, family):
    """Beam search reorders and expands the cache; headless and pruned layers must follow (T5: bias columns)."""
    model = model_of(family)
    kept = {"encoder": ([1], [0, 3]), "decoder": ([], [2, 3]), "cross": ([0, 1, 3], [])}
    plan = {s.path: kept[s.kind][s.layer] for s in attention_sites(model)}
    batch = inputs(model)
    options = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        with masked_heads(model, plan):
            expected = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **options)
        prune_heads(model, plan)
        pruned = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **options)
    assert torch.equal(pruned, expected)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_pruning_twice_composes(model_of, family):
    """Indices of a second plan count among the heads left; the record keeps the original numbering."""
    model, reference = model_of(family), model_of(family)
    encoder, cross = attention_sites(model, "encoder")[1].path, attention_sites(model, "cross")[0].path
    prune_heads(model, {encoder: [0, 2, 3], cross: [1, 3]})
    prune_heads(model, {encoder: [1, 2], cross: [0]})
    with masked_heads(reference, {encoder: [2, 3], cross: [1]}):
        expected = logits(reference)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)
    record = plan_record(model)
    assert record["kept_heads"]["encoder"][encoder] == [2, 3]
    assert record["kept_heads"]["cross"][cross] == [1]


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_then_load_pruned_round_trips(model_of, family, tmp_path):
    model = model_of(family)
    plan = {s.path: [s.layer, 3] if s.kind != "decoder" else [] for s in attention_sites(model)}
    prune_heads(model, plan, rule="hand-written")
    model.save_pretrained(tmp_path)
    loaded = load_pruned(tmp_path)
    assert type(loaded) is type(model)
    assert plan_record(loaded) == plan_record(model) and plan_record(loaded)["rule"] == "hand-written"
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
    assert torch.equal(greedy(loaded), greedy(model))
    half = load_pruned(tmp_path, dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16 and greedy(half).shape[0] == 2


def test_load_pruned_refuses_a_model_that_was_not_pruned(model_of, tmp_path):
    model_of("marian").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no head plan"):
        load_pruned(tmp_path)


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_masked_heads_is_the_gated_model_with_binary_gates(model_of, family):
    model = model_of(family)
    unmasked = logits(model)
    gates = attach_gates(model)
    with torch.no_grad():
        for gate in gates.gates:
            gate.log_alpha.copy_(torch.tensor([2.0, -1.0, 0.5, -3.0]))
    gates.set_mode("binary")
    gated = logits(model)
    gates.remove()
    with masked_heads(model, gates.plan()):
        masked = logits(model)
    torch.testing.assert_close(masked, gated, rtol=0, atol=0)
    assert not torch.allclose(masked, unmasked)
    torch.testing.assert_close(logits(model), unmasked, rtol=0, atol=0)  # the masking gates are gone again


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"model.encoder.layers.7.self_attn": [0]}, "not prunable modules"),
        ({"model.encoder.layers.0": [0]}, "not prunable modules"),
        ({"model.encoder.layers.0.self_attn": [4]}, r"head 4 does not exist \(the module has heads 0..3\)"),
        ({"model.encoder.layers.0.self_attn": [-1]}, "head -1 does not exist"),
        ({"model.encoder.layers.0.self_attn": [1, 1]}, "listed twice"),
        ({"model.encoder.layers.0.self_attn": [0.5]}, "not an integer"),
        ({"model.encoder.layers.0.self_attn": [True]}, "not an integer"),
        ({"model.encoder.layers.0.self_attn": 2}, "must be a list of head indices"),
    ],
)
def test_invalid_plans_are_refused_before_anything_is_cut(model_of, plan, message):
    model = model_of("bart")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    valid = {"model.decoder.layers.0.self_attn": [0]}
    with pytest.raises(ValueError, match=message):
        prune_heads(model, {**valid, **plan})
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert plan_record(model) is None


def test_plan_must_be_a_mapping(model_of):
    with pytest.raises(TypeError, match="mapping"):
        check_plan(model_of("bart"), [("model.encoder.layers.0.self_attn", [0])])


def test_check_plan_accepts_tensors_and_sorts(model_of):
    plan = check_plan(model_of("bart"), {"model.encoder.layers.0.self_attn": torch.tensor([3, 0])})
    assert plan == {"model.encoder.layers.0.self_attn": [0, 3]}


def test_a_directory_saved_with_a_format_1_record_still_loads(model_of, tmp_path):
    """Records written before grouped heads (format 1: one layout, kept heads only) load with the same shapes."""
    import json

    model = model_of("t5")
    plan = {s.path: [s.layer, 3] if s.kind != "decoder" else [] for s in attention_sites(model)}
    prune_heads(model, plan)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    record = config["gatedprune"]
    layout = record["layout"]["encoder"]
    config["gatedprune"] = {
        "format": 1, "kept_heads": record["kept_heads"], "num_heads": record["num_heads"], "rule": None,
        "layout": {"q": "q", "k": "k", "v": "v", "o": "o", "num_heads_attr": "n_heads",
                   "head_dim_attr": layout["head_dim_attr"], "inner_dim_attr": "inner_dim",
                   "position_bias_attr": "relative_attention_bias"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_pruned(tmp_path)
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
    assert torch.equal(greedy(loaded), greedy(model))
