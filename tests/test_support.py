"""Every class the support table (docs/guide/models.md) calls supported passes the support checks, the table is complete, and
its columns per kind (heads, FFN units, layers) say what the checks say."""

import json
from pathlib import Path

import pytest
import torch

from gatedprune.reports.support import (
    GROUPS, NotSupported, all_classes, build_tiny, check_gates, check_layer_gates, check_surgery, check_unit_gates,
    check_kind, PLAN, prepare, tiny_config,
)
from gatedprune.structures.ffn import FFNSite
from gatedprune.structures.layers import LayerSite

ROOT = Path(__file__).resolve().parents[1]
TABLE = json.loads((ROOT / "docs" / "support.json").read_text())
SUPPORTED = {row["class"]: row for row in TABLE["classes"] if row["supported"]}
CLASSES = {cls.__name__: cls for _, cls in all_classes()}


def test_table_lists_every_class_of_both_mappings():
    assert sorted(row["class"] for row in TABLE["classes"]) == sorted(cls.__name__ for _, cls in all_classes())
    readme = (ROOT / "docs" / "guide" / "models.md").read_text()
    assert all(f"| {row['class']} |" in readme for row in TABLE["classes"])
    assert all(row["reason"] for row in TABLE["classes"] if not row["supported"])


def test_every_class_has_a_result_per_kind_and_heads_keep_the_old_keys():
    readme = (ROOT / "docs" / "guide" / "models.md").read_text()
    assert "| model_type | class | layout | heads | FFN units | layers |" in readme
    for row in TABLE["classes"]:
        assert sorted(row["kinds"]) == sorted(GROUPS)
        assert row["kinds"]["heads"] == {"supported": row["supported"], "reason": row["reason"]}
        for result in row["kinds"].values():
            assert result["supported"] == (result["reason"] is None)
            assert result["reason"] is None or "\n" not in result["reason"]


# one class supported for every kind, one whose tiny config has sparse (mixture-of-experts) layers, one whose are
# all dense, one whose speech encoder has no FFN of a known layout, and one of the t5-like layout
KIND_CLASSES = ("MarianMTModel", "SwitchTransformersForConditionalGeneration", "NllbMoeForConditionalGeneration",
                "SpeechEncoderDecoderModel", "T5ForConditionalGeneration")


@pytest.mark.parametrize("group", ["ffn", "layers"])
@pytest.mark.parametrize("name", KIND_CLASSES)
def test_the_column_of_a_kind_says_what_its_checks_say(name, group, tmp_path):
    cls = CLASSES[name]
    (row,) = [row for row in TABLE["classes"] if row["class"] == name]
    assert row["layout"] == prepare(cls)
    result = row["kinds"][group]
    if result["supported"]:
        check_kind(cls, group, tmp_path)
    else:
        with pytest.raises(NotSupported) as failed:
            check_kind(cls, group, tmp_path)
        assert str(failed.value) == result["reason"]


def test_the_expected_columns_of_a_few_classes():
    kinds = {row["class"]: {g: r["supported"] for g, r in row["kinds"].items()} for row in TABLE["classes"]}
    assert kinds["MarianMTModel"] == kinds["T5ForConditionalGeneration"] == dict.fromkeys(GROUPS, True)
    switch = next(row for row in TABLE["classes"] if row["class"] == "SwitchTransformersForConditionalGeneration")
    assert "mixture of experts" in switch["kinds"]["ffn"]["reason"] and switch["kinds"]["heads"]["supported"]
    # its tiny model holds a router (sparse layers), the NLLB-MoE one none (2 layers, sparse every 4th)
    assert any(n.endswith("router") for n, _ in build_tiny(CLASSES[switch["class"]]).named_modules())
    nllb = build_tiny(CLASSES["NllbMoeForConditionalGeneration"])
    assert not any(n.endswith("router") for n, _ in nllb.named_modules())
    assert kinds["NllbMoeForConditionalGeneration"]["ffn"]


def test_the_unit_and_layer_checks_catch_a_gate_in_the_wrong_place(monkeypatch):
    cls = CLASSES["MarianMTModel"]
    attach = FFNSite.attach
    # the gates of units 1 and 3 act on units 2 and 4: open gates still change nothing, closed ones the wrong units
    monkeypatch.setattr(FFNSite, "attach", lambda site, value: attach(site, lambda t: torch.roll(value(t), 1)))
    with pytest.raises(NotSupported, match="a closed encoder unit gate is not its input rows zeroed"):
        check_unit_gates(cls)
    monkeypatch.setattr(LayerSite, "attach", lambda site, value: [])  # a layer gate that gates nothing
    with pytest.raises(NotSupported, match="a closed encoder layer gate is not the layer deleted"):
        check_layer_gates(cls)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_class_passes_the_checks(name, tmp_path):
    cls = CLASSES[name]
    check_gates(cls)
    check_surgery(cls, lambda site: PLAN[site.kind][site.layer], tmp_path / "some")
    check_surgery(cls, lambda site: [], tmp_path / "none")


def test_tiny_config_shrinks_by_field_names():
    import transformers

    config = tiny_config(transformers.T5GemmaConfig())
    encoder = config.encoder
    assert (encoder.num_hidden_layers, encoder.num_attention_heads, encoder.num_key_value_heads) == (2, 4, 2)
    assert len(encoder.layer_types) == 2 and encoder.hidden_size == 32
    bart = tiny_config(transformers.BartConfig())
    assert (bart.d_model, bart.encoder_layers, bart.decoder_attention_heads, bart.vocab_size) == (32, 2, 4, 128)
    assert max(bart.pad_token_id, bart.eos_token_id, bart.decoder_start_token_id) < 128
