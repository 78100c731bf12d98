"""What was written before the package moved into subfolders still works: a run directory (its recorded config
names the old ``_target_`` paths), its checkpoint and its export (``tests/data/run_0.1.0``, made at 7d66e69)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from helpers import ROOT, compose_train
from gatedprune import load_pruned
from gatedprune.cli import export_command

OLD_RUN = ROOT / "tests" / "data" / "run_0.1.0"
SHAPES = ["model.from_scratch.d_model=16", "model.from_scratch.encoder_ffn_dim=32",
          "model.from_scratch.decoder_ffn_dim=32"]


@pytest.fixture
def old_run(tmp_path) -> Path:
    run = tmp_path / "old_run"
    shutil.copytree(OLD_RUN, run)
    return run


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits


def test_an_old_export_loads_both_ways(old_run):
    ids = torch.tensor([[5, 6, 7, 8, 9, 2]])
    ours = load_pruned(old_run / "pruned").eval()
    stock = transformers.AutoModelForSeq2SeqLM.from_pretrained(old_run / "pruned", trust_remote_code=True).eval()
    assert torch.equal(_logits(ours, ids), _logits(stock, ids))


def test_an_old_run_exports_with_heads_removed(old_run, tmp_path):
    out = tmp_path / "export"
    assert export_command([str(old_run), str(out), "--top-k", "12"]) == 0
    report = json.loads((out / "export_report.json").read_text())
    assert report["heads_kept"]["total"] == [12, 24] and report["verification"]["passed"]
    assert sum(p.numel() for p in load_pruned(out).parameters()) == report["params_after"]


def test_an_old_run_resumes_and_its_export_is_evaluated(old_run, tmp_path):
    from gatedprune.reports.evaluate import evaluate_dir
    from gatedprune.train import train

    scored = evaluate_dir(old_run / "pruned", "test")  # the run's recorded config: old _target_ paths
    assert scored["sentences"] == 40 and 0 <= scored["bleu"] <= 100
    metrics = train(compose_train(tmp_path / "resumed", "experiment=smoke", *SHAPES, "trainer.max_steps=24",
                                  f"resume={old_run}"))
    assert metrics["steps"] == 24 and metrics["export"]["verification"]["passed"]


def test_a_sweep_compares_settings_by_where_targets_live_now():
    from gatedprune.reports.sweep import _canonical_targets

    old = {"pruning": {"_target_": "gatedprune.methods.L0", "l0_lambda": 0.1},
           "callbacks": [{"_target_": "gatedprune.callbacks.LastCheckpoint"}], "trainer": {"_target_": "lightning.Trainer"}}
    assert _canonical_targets(old) == {
        "pruning": {"_target_": "gatedprune.methods.gated.L0", "l0_lambda": 0.1},
        "callbacks": [{"_target_": "gatedprune.training.callbacks.LastCheckpoint"}],
        "trainer": {"_target_": "lightning.Trainer"}}


def test_every_target_an_old_run_recorded_still_resolves():
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    def targets(node):
        if isinstance(node, dict):
            yield from ([node["_target_"]] if "_target_" in node else [])
            for value in node.values():
                yield from targets(value)
        elif isinstance(node, list):
            for value in node:
                yield from targets(value)

    recorded = OmegaConf.to_container(OmegaConf.load(OLD_RUN / ".hydra" / "config.yaml"), resolve=False)
    found = sorted(set(targets(recorded)))
    assert "gatedprune.lightning_module.GatedSeq2Seq" in found and len(found) >= 10
    for target in found:
        assert callable(get_object(target)), target


def test_a_recorded_run_composes_again_with_its_own_group_choices(tmp_path):
    """The defaults change (the default model is now the kept teacher): a run is rebuilt from the groups it ran
    with (hydra.yaml), then its own command line, so its model and data are the ones it trained."""
    from omegaconf import OmegaConf

    from gatedprune.training.rundir import recorded_command

    record = tmp_path / ".hydra"
    record.mkdir()
    OmegaConf.save({"hydra": {"runtime": {"choices": {"model": "scratch_mbart", "pruning": "l0", "experiment": None,
                                                      "hydra/launcher": "basic", "quality": "plain"}}}},
                   record / "hydra.yaml")
    OmegaConf.save(["model.from_scratch.decoder_layers=1", "+quality=plain", "seed=2"], record / "overrides.yaml")
    # a choice typed on the command line (+quality) is not given twice; hydra's own groups and unset ones are left out
    assert recorded_command(tmp_path) == ["model=scratch_mbart", "pruning=l0", "model.from_scratch.decoder_layers=1",
                                          "+quality=plain", "seed=2"]
    assert recorded_command(tmp_path, groups=("model",)) == ["model=scratch_mbart", "model.from_scratch.decoder_layers=1"]
    cfg = compose_train(tmp_path, *recorded_command(tmp_path, groups=("model",)))
    assert cfg.model.from_scratch.decoder_layers == 1  # composes with today's configs
