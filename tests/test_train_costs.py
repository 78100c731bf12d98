"""train.py with a cost target: a latency budget is measured at set-up, cached beside the checkpoint, met by the
export (predicted), reported; a FLOPs budget is met as torch's own counter counts it; targets below the floor are
refused in one line."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import transformers

from helpers import FAKE_BASE, FAKE_TIMER, bart_structures, error_line, run_train, train_dense
from helpers import FAKE_COSTS as FAKE
from gatedprune import load_pruned
from gatedprune.costs.flops import count_flops
from gatedprune.costs.table import read
from gatedprune.structures.kinds import ALL_KINDS

EVERY_KIND = f"pruning.kinds=[{','.join(ALL_KINDS)}]"
SMALL = ("pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4", "pruning.workload.repeats=1")


# the dense smoke model's structures (conf/experiment/smoke.yaml: 2 + 2 layers, 4 heads, FFN 64)
SMOKE_STRUCTURES = {"encoder": 8, "decoder": 8, "cross": 8, "encoder_ffn": 128, "decoder_ffn": 128, "encoder_layer": 2,
                    "decoder_layer": 2}


def test_a_latency_target_is_measured_cached_and_met(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", EVERY_KIND, *SMALL,
                     "pruning.target_warmup_steps=5", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cached,) = (run / "checkpoints").glob("latency-*.json")
    key, cost, _ = read(cached)
    assert key["workload"]["target_tokens"] == 4 and key["shapes"]["model_type"] == "mbart"
    assert cost.base == pytest.approx(FAKE_BASE) and cost.coefficients == pytest.approx(FAKE)  # the fit recovers them
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["target_latency"] == 0.6 and metrics["costs"]["source"] == "measured"
    assert metrics["costs"]["fit_error"] == pytest.approx(0, abs=1e-9)  # the fake clock is linear
    assert "its largest error over its 17 probes 0.0%" in proc.stdout
    # the prediction, recomputed here from the timer's own numbers and the structures the export kept
    price = lambda n: FAKE_BASE + sum(FAKE[k] * n[k] for k in ALL_KINDS)  # noqa: E731
    kept = price(bart_structures(load_pruned(run / "pruned"))) / price(SMOKE_STRUCTURES)
    assert report["predicted"]["latency"] == pytest.approx(kept) and kept <= 0.6
    assert report["predicted"]["speed_up"] == pytest.approx(1 / kept)
    # the log follows the expected latency beside the ramped target, which falls from 1 to 0.6 over the 5 warm-up steps
    rows = [r for r in csv.DictReader(open(run / "csv" / "metrics.csv")) if r.get("train/expected_latency")]
    targets = [float(r["train/target_latency"]) for r in rows]
    assert rows and targets == sorted(targets, reverse=True) and targets[-1] == pytest.approx(0.6)
    assert all(0 < float(r["train/expected_latency"]) <= 1 for r in rows)


@pytest.mark.parametrize("ceiling", ["false", "true"])
def test_a_ceiling_target_keeps_lambda1_at_or_above_zero_through_training(tmp_path, ceiling):
    """With the target ramping down from the dense cost, the cost sits under the ramp at first and lambda1 sinks
    below zero; pruning.target_ceiling=true holds it at zero instead, at every logged step."""
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", EVERY_KIND, *SMALL,
                     "pruning.target_warmup_steps=20", "pruning.lagrangian_lr=0.5", f"pruning.target_ceiling={ceiling}",
                     "export.enabled=false", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lambdas = [float(r["train/lambda1"]) for r in csv.DictReader(open(run / "csv" / "metrics.csv"))
               if r.get("train/lambda1")]
    assert lambdas
    if ceiling == "true":
        assert min(lambdas) >= 0 and max(lambdas) > 0  # held at zero under the target, raised above it
    else:
        assert min(lambdas) < 0


# every odd probe timed twice as long as its structures cost, at every timing: a load no additive fit explains
LOADED_TIMER = (*FAKE_TIMER[:-1], "timers.TIMERS['torch'] = lambda models, w: [t * (2 if j % 2 else 1) for j, t in "
                "enumerate(helpers.fake_timer(models, w))]")


# the fake clock with a decoder layer 10 ms dearer: the same machine under another load, as a run's own fit sees it
SKEWED_TIMER = (*FAKE_TIMER[:-1], "timers.TIMERS['torch'] = lambda models, w: [t + 0.01 * "
                "helpers.bart_structures(m)['decoder_layer'] for t, m in zip(helpers.fake_timer(models, w), models)]")


def _plan(run) -> dict:
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    return {part: report[part] for part in ("plan", "plan_units", "plan_layers")}


def test_two_runs_on_one_machine_ship_one_plan_from_one_measured_fit(tmp_path, machine_cache):
    """Item 3 of issue 38 with no table: the first run times the fit, the second (its timings skewed as another load
    would skew them) is priced by it and ships the same plan; a run that times its own prices the kinds otherwise."""
    setting = ("pruning=l0_budget", "pruning.target_latency=0.6", EVERY_KIND, *SMALL, "pruning.target_warmup_steps=5")
    first = run_train(tmp_path / "first", *setting, prefix=FAKE_TIMER)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(tmp_path / "second", *setting, prefix=SKEWED_TIMER)
    assert second.returncode == 0, second.stderr[-3000:]
    (kept,) = (machine_cache / "latency").glob("latency-*.json")
    costs = [json.loads((tmp_path / run / "metrics.json").read_text())["costs"] for run in ("first", "second")]
    assert costs[0]["source"] == "measured" and costs[1]["source"] == "cache" and costs[1]["path"] == str(kept)
    assert costs[1]["coefficients"] == costs[0]["coefficients"] == pytest.approx(FAKE)
    assert "timed earlier on this machine" in second.stdout and "measuring latency" not in second.stdout
    assert _plan(tmp_path / "second") == _plan(tmp_path / "first")
    # the second run with a machine cache of its own times its probes, and its fit follows its timings
    own = run_train(tmp_path / "own", *setting, prefix=SKEWED_TIMER, env={"GATEDPRUNE_CACHE": str(tmp_path / "c")})
    assert own.returncode == 0, own.stderr[-3000:]
    mine = json.loads((tmp_path / "own" / "metrics.json").read_text())["costs"]
    assert mine["source"] == "measured"
    assert mine["coefficients"]["decoder_layer"] == pytest.approx(FAKE["decoder_layer"] + 0.01)


def test_a_latency_fit_its_probes_disagree_with_is_refused_in_one_line_before_training(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", EVERY_KIND, *SMALL, prefix=LOADED_TIMER)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_line(proc).startswith("error: the latency fit misses its probe ")
    assert "after 15 timings of its probes (pruning.workload.fit_tolerance=0.2)" in error_line(proc)
    assert proc.stdout.count("timing the probes again") == 14  # pruning.workload.fit_attempts, 15 by default
    assert not list(run.rglob("latency-*.json")) and not list(run.rglob("*.ckpt"))  # nothing cached, nothing trained


def test_a_flops_target_is_met_as_torch_counts_flops(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_flops=0.5", EVERY_KIND, *SMALL,
                     "pruning.target_warmup_steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pruned = load_pruned(run / "pruned").eval()
    src = torch.randint(3, pruned.config.vocab_size - 1, (1, 6))

    def job(model):
        with torch.no_grad():
            model.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=4, min_new_tokens=4,
                           num_beams=1, do_sample=False)

    # the dense smoke model (conf/experiment/smoke.yaml: 2 + 2 layers, 4 heads, FFN 64), built here from its numbers
    config = {k: v for k, v in json.loads((run / "pruned" / "config.json").read_text()).items()
              if k not in ("gatedprune", "auto_map", "architectures")}
    config.update(encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  encoder_attention_heads=4, decoder_attention_heads=4)
    dense = transformers.MBartForConditionalGeneration(transformers.MBartConfig(**config)).eval()
    assert count_flops(job, pruned) <= 0.5 * count_flops(job, dense)
    assert json.loads((run / "pruned" / "export_report.json").read_text())["predicted"]["flops"] <= 0.5


@pytest.mark.parametrize("target", ["target_latency", "target_flops"])
def test_a_cost_target_below_the_floor_is_refused_in_one_line(tmp_path, target):
    proc = run_train(tmp_path / "run", "pruning=l0_budget", f"pruning.{target}=0.01", "pruning.kinds=[encoder]", *SMALL,
                     prefix=FAKE_TIMER)
    assert proc.returncode == 2
    assert f"pruning.{target}=0.01 is below what removing every gated structure reaches" in error_line(proc)
    assert not (tmp_path / "run").exists()


def test_random_draws_at_the_latency_the_gated_forks_are_budgeted_with(tmp_path):
    dense = train_dense(tmp_path / "dense")
    run = tmp_path / "random"
    proc = run_train(run, f"resume={dense}", "pruning=random", "pruning.latency=[0.7,0.5]", EVERY_KIND, *SMALL,
                     prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cached,) = (dense / "checkpoints").glob("latency-*.json")  # beside the checkpoint forked: shared by its forks
    assert read(cached)[1].coefficients == pytest.approx(FAKE)
    price = lambda n: FAKE_BASE + sum(FAKE[k] * n[k] for k in ALL_KINDS)  # noqa: E731
    dense_price = price(SMOKE_STRUCTURES)
    for budget in (0.7, 0.5):
        metrics = json.loads((run / "levels" / f"latency_{budget}" / "metrics.json").read_text())
        kept = price(bart_structures(load_pruned(run / "levels" / f"latency_{budget}" / "pruned"))) / dense_price
        assert kept <= budget and metrics["export"]["predicted"]["latency"] == pytest.approx(kept)
        assert metrics["target_latency"] == budget and metrics["target_params"] is None
        assert metrics["settings"]["costs"]["source"] == "measured"
        assert metrics["settings"]["costs"]["fit_error"] == pytest.approx(0, abs=1e-9)  # the fake clock is linear
    assert "latency budget" in proc.stdout
    again = run_train(tmp_path / "random2", f"resume={dense}", "pruning=random", "pruning.latency=[0.6]", "seed=3",
                      EVERY_KIND, *SMALL, prefix=FAKE_TIMER)
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = json.loads((tmp_path / "random2" / "levels" / "latency_0.6" / "metrics.json").read_text())
    assert metrics["settings"]["costs"] == {**metrics["settings"]["costs"], "source": "cache", "path": str(cached)}

