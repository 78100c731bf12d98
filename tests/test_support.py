"""Every class the README's support table calls supported passes the support checks, and the table is complete."""

import json
from pathlib import Path

import pytest

from gatedprune.reports.support import all_classes, check_gates, check_surgery, PLAN, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TABLE = json.loads((ROOT / "docs" / "support.json").read_text())
SUPPORTED = {row["class"]: row for row in TABLE["classes"] if row["supported"]}
CLASSES = {cls.__name__: cls for _, cls in all_classes()}


def test_table_lists_every_class_of_both_mappings():
    assert sorted(row["class"] for row in TABLE["classes"]) == sorted(cls.__name__ for _, cls in all_classes())
    readme = (ROOT / "README.md").read_text()
    assert all(f"| {row['class']} |" in readme for row in TABLE["classes"])
    assert all(row["reason"] for row in TABLE["classes"] if not row["supported"])


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
