"""train.py with feed-forward units and layers gated: a run that gates every kind trains, exports, verifies and
reloads; a parameter budget is met; a heads-only checkpoint forks into a run with every kind; bad settings are
refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from helpers import FAKE_TIMER, ROOT, compose_train, error_line, run_train, train_dense
from gatedprune import load_pruned
from gatedprune.structures.kinds import ALL_KINDS
from gatedprune.surgery.cut import count_parameters

EVERY_KIND = f"pruning.kinds=[{','.join(ALL_KINDS)}]"
HARD = ("pruning.l0_lambda=20", "pruning.gate_lr=0.5", "trainer.max_steps=40")  # closes structures of every kind


@pytest.fixture(scope="module")
def every_kind_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("every_kind") / "run"
    proc = run_train(run, EVERY_KIND, *HARD, "export.formats=[hf,ct2]", "export.quantization=int8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_the_shipped_model_is_converted_to_each_format_asked_for(every_kind_run):
    """export.formats=[hf,ct2]: <run>/deploy/ct2 holds the shipped model in CTranslate2 (int8), verified; read here
    in CTranslate2 itself."""
    import ctranslate2

    metrics = json.loads((every_kind_run / "metrics.json").read_text())
    report = metrics["deploy"]["ct2"]
    assert report["verification"]["passed"] and report["quantization"] == "int8"
    assert report["from"] == str(every_kind_run / "pruned")  # no fine-tuning in this run: the export itself
    assert report["verification"]["scored"] == "references" and "int8" in report["bleu"]
    speed = report["tokens_per_second"]  # the gated model before pruning, converted beside it
    assert speed["pruned_over_dense"] == pytest.approx(speed["float32"] / speed["dense_float32"])
    directory = every_kind_run / "deploy" / "ct2"
    assert json.loads((directory / "deploy_report.json").read_text())["verification"] == report["verification"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)  # the tokenizer travels with the model
    sources = [json.loads(line)["source"] for line in (every_kind_run / "val_pairs.jsonl").read_text().splitlines()[:3]]
    tokens = [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in sources]
    results = ctranslate2.Translator(str(directory)).translate_batch(tokens, max_decoding_length=8)
    assert len(results) == 3 and all(len(r.hypotheses[0]) <= 8 for r in results)


def test_a_run_gating_every_kind_exports_a_verified_smaller_model(every_kind_run):
    metrics = json.loads((every_kind_run / "metrics.json").read_text())
    report = json.loads((every_kind_run / "pruned" / "export_report.json").read_text())
    assert metrics["penalty_normalisation"] == "params"  # the default once other kinds are gated
    assert report["verification"]["passed"] and report["verification"]["greedy_identical"]
    removed = {kind: total - kept for kind, (kept, total) in {**report["units_kept"], **report["layers_kept"]}.items()}
    assert removed["encoder_ffn"] > 0 and removed["decoder_ffn"] > 0  # lambda 20 closes units of both stacks
    model = load_pruned(every_kind_run / "pruned")
    assert count_parameters(model) == report["params_after"] < report["params_before"]
    widths = [layer.fc1.out_features for layer in model.model.decoder.layers]
    assert sum(widths) == report["units_kept"]["decoder_ffn"][0]
    assert len(model.model.decoder.layers) == report["layers_kept"]["decoder_layer"][0] >= 1
    assert model.config.decoder_layers == len(model.model.decoder.layers)
    card = (every_kind_run / "pruned" / "README.md").read_text()
    assert "FFN width" in card and f"{widths[0]}/64" in card


def test_a_parameter_budget_keeps_at_most_its_target(tmp_path):
    run = tmp_path / "budget"
    proc = run_train(run, EVERY_KIND, "pruning=l0_budget", "pruning.target_params=0.6", "pruning.target_warmup_steps=10",
                     "trainer.max_steps=40", "pruning.gate_lr=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    budget = report["params_budget"]
    assert budget["prunable_kept"] <= budget["prunable_allowed"]
    assert 0.5 < budget["non_embedding_kept_fraction"] <= 0.6  # the greedy fill comes close to the target
    assert report["rule"].startswith("params, at most")
    assert "parameter budget:" in proc.stderr + proc.stdout


def test_a_heads_only_dense_checkpoint_forks_into_a_run_with_every_kind(tmp_path):
    dense = train_dense(tmp_path / "dense") / "checkpoints" / "dense.ckpt"
    before = torch.load(dense, map_location="cpu", weights_only=True)
    assert before["gate_kinds"] == ["encoder", "decoder", "cross"]
    run = tmp_path / "fork"
    proc = run_train(run, EVERY_KIND, f"resume={dense}", *HARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["gate_kinds"] == list(ALL_KINDS) and last["global_step"] == 40
    heads = sum(1 for key in before["state_dict"] if key.startswith("gates.gates."))
    new = [v for k, v in last["state_dict"].items() if k.startswith("gates.gates.") and int(k.split(".")[2]) >= heads]
    assert new and all((v != 3.0).any() for v in new)  # the new gates started at init_log_alpha 3 and trained
    assert json.loads((run / "pruned" / "export_report.json").read_text())["verification"]["passed"]


def test_the_every_kind_default_dense_checkpoint_forks_into_a_heads_only_run(tmp_path):
    # the default (pruning=speed: a latency budget on every kind) leaves its dense.ckpt at the end of the dense phase;
    # the heads-only methods (the lambda sweep, compare, quality) fork it: its other gates, never trained, are dropped
    source = tmp_path / "default"
    proc = run_train(source, "pruning=speed", "trainer.max_steps=12", "export.enabled=false", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dense = torch.load(source / "checkpoints" / "dense.ckpt", map_location="cpu", weights_only=True)
    assert dense["gate_kinds"] == list(ALL_KINDS) and dense["global_step"] == 10
    extra = dense["state_dict"]["gates._extra_state"]
    heads = [i for i, kind in enumerate(extra["kinds"]) if kind in ("encoder", "decoder", "cross")]
    assert all((dense["state_dict"][f"gates.gates.{i}.log_alpha"] == 3.0).all() for i in range(len(extra["kinds"])))
    fork = tmp_path / "fork"
    proc = run_train(fork, f"resume={source / 'checkpoints' / 'dense.ckpt'}", *HARD)  # smoke: pruning=l0, heads
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.load(fork / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["gate_kinds"] == ["encoder", "decoder", "cross"] and last["global_step"] == 40
    gates = {k: v for k, v in last["state_dict"].items() if k.startswith("gates.gates.")}
    assert len(gates) == len(heads) and all((v != 3.0).any() for v in gates.values())  # the heads' gates trained
    assert last["state_dict"]["gates._extra_state"]["paths"] == [extra["paths"][i] for i in heads]
    assert json.loads((fork / "pruned" / "export_report.json").read_text())["verification"]["passed"]
    # a heads-only method with state of its own (a head budget's multipliers, the optimiser's third group): the
    # dropped gates' optimiser indices close up under it, and its multipliers train
    budget = tmp_path / "budget"
    proc = run_train(budget, f"resume={source / 'checkpoints' / 'dense.ckpt'}", "pruning=l0_budget",
                     "pruning.target_heads=12", "gated_steps=5", "export.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.load(budget / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    groups = last["optimizer_states"][0]["param_groups"]
    assert len(groups[1]["params"]) == len(heads) and last["state_dict"]["budget.lambda1"].abs().sum() > 0
    assert groups[2]["params"] == [sum(len(g["params"]) for g in groups[:2]) + i for i in range(2)]
    # a checkpoint whose other gates have trained (step 12: two gated steps) is not cut down: dropping them would
    # change the model; the run is refused in one line, before its directory is made
    refused = run_train(tmp_path / "refused", f"resume={source / 'checkpoints' / 'last.ckpt'}", *HARD)
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert (f"gates {list(ALL_KINDS)} but pruning.kinds is ['encoder', 'decoder', 'cross']; resume with the settings "
            "that wrote it") in error_line(refused)


def test_an_old_heads_only_run_resumes_with_every_kind(tmp_path):
    from gatedprune.train import train

    old = tmp_path / "old_run"
    shutil.copytree(ROOT / "tests" / "data" / "run_0.1.0", old)  # written at 7d66e69, before other kinds existed
    shapes = ["model.from_scratch.d_model=16", "model.from_scratch.encoder_ffn_dim=32",
              "model.from_scratch.decoder_ffn_dim=32"]
    metrics = train(compose_train(tmp_path / "resumed", "experiment=smoke", *shapes, EVERY_KIND, "trainer.max_steps=24",
                                  f"resume={old}"))
    assert metrics["steps"] == 24 and metrics["export"]["verification"]["passed"]


@pytest.mark.parametrize("overrides, says", [
    ((EVERY_KIND, "pruning.distill.hidden=1.0"),
     "pruning.distill.hidden=1.0 with layer kinds ['encoder_layer', 'decoder_layer']: layer distillation needs a map"),
    (("pruning.ffn_group=0",), "pruning.ffn_group=0; allowed: an integer >= 1"),
    (("pruning=l0_budget", "pruning.target_heads=12", "pruning.target_params=0.5"),
     "a budget takes one target; allowed: one of them, the others null"),
    (("pruning=l0_budget", "pruning.target_params=1.5"), "pruning.target_params=1.5; allowed: a fraction in (0, 1)"),
])
def test_bad_settings_of_the_new_kinds_are_refused_in_one_line(tmp_path, overrides, says):
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(compose_train(tmp_path / "run", "experiment=smoke", *overrides).pruning,
                                      resolve=True)
    with pytest.raises(ValueError) as refused:  # the method's settings, checked before any model or data loads
        get_class(settings.pop("_target_"))(**settings)
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides, says", [
    (("pruning.kinds=[encoder_ffn]", "pruning.ffn_group=5"),
     "pruning.ffn_group=5: model.encoder.layers.0.fc2 has 64 units, not a multiple of 5"),
    (("pruning=l0_budget", "pruning.kinds=[encoder_ffn]", "pruning.target_params=0.01"),
     "pruning.target_params=0.01 is below what removing every gated structure reaches"),
])
def test_settings_the_model_cannot_meet_are_refused_in_one_line(tmp_path, overrides, says):
    proc = run_train(tmp_path / "run", *overrides)
    assert proc.returncode != 0 and says in error_line(proc)
    assert not (tmp_path / "run" / "pruned").exists()


def test_the_sweep_speed_benchmark_times_every_export_of_a_sweep(every_kind_run, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_speed", ROOT / "benchmarks" / "sweep_speed.py")
    sweep_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep_speed)
    out = tmp_path / "speed.md"
    assert sweep_speed.main([str(every_kind_run.parent), "--dense", str(every_kind_run / "checkpoints" / "dense.ckpt"),
                             "--sentences", "2", "--repeats", "1", "--new-tokens", "4", "--out", str(out)]) == 0
    (result,) = json.loads(out.with_suffix(".json").read_text())["results"]
    report = json.loads((every_kind_run / "pruned" / "export_report.json").read_text())
    assert result["params"] == report["params_after"] and set(result["speed"]) == {"1", "32"}
    assert all(cell["wall"] > 0 and cell["cpu"] > 0 for cell in result["speed"].values())
    assert "| run | lambda |" in out.read_text()


def test_the_runtimes_benchmark_times_dense_and_pruned_in_each_runtime(every_kind_run, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("runtimes", ROOT / "benchmarks" / "runtimes.py")
    runtimes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runtimes)
    out = tmp_path / "runtimes.md"
    chosen = ["transformers", "ct2 float32", "ct2 int8"]
    assert runtimes.main(["--dense", str(every_kind_run / "checkpoints" / "dense.ckpt"), "--exports",
                          str(every_kind_run / "pruned"), "--skip-base", "--runtimes", *chosen, "--threads", "1",
                          "--sentences", "2", "--repeats", "1", "--new-tokens", "4", "--untrained", "--out",
                          str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    (group,) = results["groups"].values()
    # beside the checkpoint, an untrained model of its shapes: the same parameters, other weights
    assert list(group["variants"])[:2] == ["default dense", "default dense, untrained"]
    assert group["variants"]["default dense, untrained"]["params"] == group["variants"]["default dense"]["params"]
    untrained = group["variants"]["default dense, untrained"]
    assert untrained["note"] == "the dense checkpoint's config, random weights (seed 0)"
    cells = {(c["variant"], c["runtime"], c["batch"]) for c in group["cells"] if c["wall"] > 0}
    assert cells == {(v, r, b) for v in group["variants"] for r in chosen for b in (1, 32)}
    # the same sentences in each runtime: float32 CTranslate2 gives generate()'s translations, so its BLEU
    assert all(b["ct2 float32"] == pytest.approx(b["transformers"]) for b in results["bleu"].values())
    assert "| model | runtime | threads |" in out.read_text()
    assert "--runtimes transformers 'ct2 float32' 'ct2 int8'" in out.read_text()  # a command that runs as shown
