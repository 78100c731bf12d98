"""``pruning=even_layers``: evenly spaced decoder layers kept (first and last), the rest of the model whole, exported
verified, and fine-tuned on the dense model's translations when asked."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose_train, error_line, run_train

from gatedprune import load_pruned
from gatedprune.methods.even_layers import EvenLayers, even_layers
from gatedprune.train import train


DEEPER = "model.from_scratch.decoder_layers=3"  # the smoke model with a decoder of 3 layers


@pytest.mark.parametrize("total, keep, expected", [
    (6, 2, [0, 5]), (6, 3, [0, 2, 5]), (6, 4, [0, 2, 3, 5]), (12, 4, [0, 4, 7, 11]), (3, 2, [0, 2]), (3, 1, [0]),
    (3, 3, [0, 1, 2]), (1, 1, [0]),
])
def test_the_layers_kept_are_evenly_spaced_with_the_first_and_last(total, keep, expected):
    kept = even_layers(total, keep)
    assert kept == expected and len(kept) == keep
    if keep >= 2:  # the definition, independently: both ends, and gaps that differ by at most one layer
        gaps = [b - a for a, b in zip(kept, kept[1:])]
        assert kept[0] == 0 and kept[-1] == total - 1 and max(gaps) - min(gaps) <= 1


@pytest.mark.parametrize("keep", [0, 4, True, 1.5])
def test_a_count_the_model_does_not_have_is_refused_in_one_line(keep):
    with pytest.raises(ValueError) as refused:
        even_layers(3, keep)
    assert str(refused.value) == (f"pruning.decoder_layers names {keep!r}; allowed: layer counts from 1 to the "
                                  "model's 3 decoder layers")


@pytest.mark.parametrize("settings, message", [
    ({"kinds": ["encoder_layer"]}, "pruning=even_layers drops decoder layers; allowed: pruning.kinds naming "
                                   "decoder_layer (got encoder_layer)"),
    ({"decoder_layers": [2, 2]}, "pruning.decoder_layers=[2, 2]; allowed: one or more distinct layer counts"),
    ({"decoder_layers": []}, "pruning.decoder_layers=[]; allowed: one or more distinct layer counts"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError) as refused:
        EvenLayers(**settings)
    assert str(refused.value) == message


@pytest.fixture(scope="module")
def dense3(tmp_path_factory):
    """A smoke dense run whose decoder has 3 layers."""
    run = tmp_path_factory.mktemp("even") / "dense"
    proc = run_train(run, "trainer.max_steps=10", DEEPER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_each_level_keeps_the_dense_models_own_layers(dense3, tmp_path):
    run = tmp_path / "even"
    metrics = train(compose_train(run, "experiment=smoke", f"resume={dense3}", DEEPER, "pruning=even_layers",
                                  "pruning.decoder_layers=[2,1]"))
    assert [level["name"] for level in metrics["levels"]] == ["decoder_2_of_3", "decoder_1_of_3"]
    dense = torch.load(dense3 / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    for name, kept in (("decoder_2_of_3", [0, 2]), ("decoder_1_of_3", [0])):
        level = json.loads((run / "levels" / name / "metrics.json").read_text())
        assert level["export"]["verification"]["passed"] and level["level"]["decoder_layers"] == kept
        pruned = load_pruned(run / "levels" / name / "pruned")
        assert pruned.config.decoder_layers == len(kept) and pruned.config.encoder_layers == 2
        for new, old in enumerate(kept):  # layer `new` of the pruned decoder is the dense model's layer `old`
            for key, value in pruned.model.decoder.layers[new].state_dict().items():
                assert torch.equal(value, dense[f"model.model.decoder.layers.{old}.{key}"]), (name, new, key)
        # every head of what stays: 2 encoder layers of 4, and 4 self- and 4 cross-attention heads per decoder layer
        assert level["target_heads"] is None and level["heads_alive"]["total"] == 2 * 4 + len(kept) * 8


def test_fine_tuning_on_the_dense_models_translations(dense3, tmp_path):
    run = tmp_path / "seqkd"
    metrics = train(compose_train(run, "experiment=smoke", f"resume={dense3}", DEEPER, "pruning=even_layers",
                                  "pruning.decoder_layers=2", "finetune.steps=2", "finetune.targets=dense_greedy",
                                  "data.max_train_pairs=30"))
    level = json.loads((run / "levels" / "decoder_2_of_3" / "metrics.json").read_text())
    assert level["finetune"]["steps"] == 2 and metrics["levels"][0]["test_bleu_finetuned"] is not None
    (cache,) = (run / "cache").glob("seqkd-*.jsonl")
    assert len(cache.read_text().splitlines()) == 30
    assert load_pruned(run / "levels" / "decoder_2_of_3" / "pruned_finetuned").config.decoder_layers == 2


def test_train_refuses_more_layers_than_the_model_has(dense3, tmp_path):
    proc = run_train(tmp_path / "run", f"resume={dense3}", DEEPER, "pruning=even_layers", "pruning.decoder_layers=5")
    assert proc.returncode == 2
    assert "pruning.decoder_layers names 5; allowed: layer counts from 1 to the model's 3 decoder layers" in \
        error_line(proc)
