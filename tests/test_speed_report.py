"""``report.speed``: the measured speed-up of the shipped model over the dense model (gatedprune.reports.speed).

The arithmetic (alternation, medians, ratios) is checked with a fake clock; real timings are never asserted.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_train, run_train
from gatedprune.reports.metrics import final_table
from gatedprune.reports.speed import SpeedOptions, Timing, alternate, greedy_job, measure_speed, speed_options
from gatedprune.shipping.export_dir import save_pruned
from gatedprune.structures.adapters import probe
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import count_parameters, prune_heads, removed_parameters


class FakeClock:
    """A clock that moves only when a model runs: each model's forward call costs its own (wall, CPU) seconds."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __call__(self) -> Timing:
        return Timing(self.wall, self.cpu)

    def charge(self, model, wall: float, cpu: float) -> None:
        def hook(*_):
            self.wall += wall
            self.cpu += cpu

        model.register_forward_hook(hook)


def test_alternate_times_in_turn_and_takes_the_median_of_each_model():
    clock = FakeClock()
    costs = {"a": [(5, 1), (1, 4), (3, 2)], "b": [(2, 9), (8, 3), (4, 6)]}  # (wall, cpu) of each timed call
    calls = []

    def job(name):
        calls.append(name)
        timed = sum(c == name for c in calls) - 1  # the first call of each is the warm-up
        wall, cpu = costs[name][timed - 1] if timed else (100, 100)
        clock.wall, clock.cpu = clock.wall + wall, clock.cpu + cpu

    a, b = alternate(job, ["a", "b"], 3, timer=clock)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then in turn
    for got, name in ((a, "a"), (b, "b")):
        assert got == Timing(statistics.median(w for w, _ in costs[name]), statistics.median(c for _, c in costs[name]))


def _pruned(dense, tmp_path: Path):
    """A copy of ``dense`` without some heads, FFN units and its last decoder layer; the plan's parameter count."""
    model = copy.deepcopy(dense)
    plan = {s.path: list(range(s.num_units // 2)) for s in structure_sites(model, ["encoder", "decoder_ffn"])}
    layers = probe(model).layers["decoder"]
    plan[layers] = list(range(len(model.get_submodule(layers)) - 1))
    params = count_parameters(model) - removed_parameters(model, plan)
    prune_heads(model, plan)
    return model.eval(), params


def test_measure_speed_reports_ratios_of_medians_params_and_file_sizes(model_of, tmp_path):
    dense = model_of("mbart")
    pruned, pruned_params = _pruned(dense, tmp_path)
    clock = FakeClock()
    clock.charge(dense, wall=0.003, cpu=0.002)  # seconds per forward call (one per generated token)
    clock.charge(pruned, wall=0.001, cpu=0.0005)
    options = SpeedOptions(batches=[1, 3], source_tokens=5, new_tokens=4, repeats=2)
    speed = measure_speed(dense, pruned, options, timer=clock)

    assert list(speed["batches"]) == ["1", "3"]
    for cell in speed["batches"].values():  # 4 forward calls per generate(): exactly new_tokens, no early stop
        assert cell["dense_ms"] == pytest.approx(4 * 3.0) and cell["pruned_ms"] == pytest.approx(4 * 1.0)
        assert cell["dense_cpu_ms"] == pytest.approx(4 * 2.0) and cell["pruned_cpu_ms"] == pytest.approx(4 * 0.5)
        assert cell["speed_up"] == pytest.approx(3.0) and cell["cpu_speed_up"] == pytest.approx(4.0)
    assert speed["params"] == {"dense": count_parameters(dense), "pruned": pruned_params}
    save_pruned(pruned, tmp_path / "export")  # the file a user ships: its size is what the report says
    assert speed["file_bytes"]["pruned"] == (tmp_path / "export" / "model.safetensors").stat().st_size
    dense.save_pretrained(tmp_path / "dense")
    assert speed["file_bytes"]["dense"] == (tmp_path / "dense" / "model.safetensors").stat().st_size
    assert speed["file_bytes"]["pruned"] < speed["file_bytes"]["dense"]
    assert speed["workload"]["new_tokens"] == 4 and speed["workload"]["repeats"] == 2


def test_measure_speed_times_at_the_threads_asked_and_gives_them_back(model_of, tmp_path):
    dense = model_of("mbart")
    pruned, _ = _pruned(dense, tmp_path)
    seen = []
    for model in (dense, pruned):
        model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    asked = before + 1
    speed = measure_speed(dense, pruned, SpeedOptions(batches=[1, 2], source_tokens=3, new_tokens=2, repeats=1,
                                                      threads=asked), timer=FakeClock())
    assert set(seen) == {asked} and speed["workload"]["threads"] == asked and torch.get_num_threads() == before
    seen.clear()
    speed = measure_speed(dense, pruned, SpeedOptions(batches=[1], source_tokens=3, new_tokens=2, repeats=1),
                          timer=FakeClock())  # None: as torch is set
    assert set(seen) == {before} and speed["workload"]["threads"] == before


def test_greedy_job_generates_exactly_new_tokens_from_the_same_sources(model_of, tmp_path):
    dense = model_of("mbart")  # whose untrained greedy stops early without min_new_tokens
    pruned, _ = _pruned(dense, tmp_path)
    job = greedy_job(dense, batch=3, source_tokens=6, new_tokens=7)
    seen = {}

    def sources_of(name):
        def hook(module, args, kwargs, out) -> None:  # None: the output stays as it was
            seen.setdefault(name, kwargs["input_ids"])
        return hook

    for name, model in (("dense", dense), ("pruned", pruned)):
        model.get_encoder().register_forward_hook(sources_of(name), with_kwargs=True)
    for model in (dense, pruned):  # decoder start + 7 tokens each, though the untrained model's EOS is likelier
        assert job(model).shape == (3, 1 + 7)
    ids = seen["dense"]  # (B, S): the same random sources for both, none of the special ids at either end
    assert ids.shape == (3, 6) and torch.equal(ids, seen["pruned"])
    assert int(ids.min()) >= 3 and int(ids.max()) < dense.config.vocab_size - 1
    assert torch.equal(greedy_job(dense, 3, 6, 7)(dense), job(dense))  # seeded: a new job draws the same


@pytest.mark.parametrize("override, named", [
    ({"batches": []}, "report.batches=[]"), ({"batches": [1, 0]}, "report.batches=[1, 0]"),
    ({"batches": [1, 1]}, "repeats a batch size"), ({"batches": [1, 2.5]}, "report.batches=[1, 2.5]"),
    ({"repeats": 0}, "report.repeats=0"), ({"new_tokens": -1}, "report.new_tokens=-1"),
    ({"source_tokens": "many"}, "report.source_tokens='many'"), ({"speed": "yes"}, "report.speed='yes'"),
    ({"repeat": 3}, "report.repeat: no such option"), ({"repeats": float("nan")}, "report.repeats=nan"),
    ({"threads": 0}, "report.threads=0"), ({"threads": "two"}, "report.threads='two'"),
])
def test_bad_report_options_are_refused_in_one_line(override, named):
    with pytest.raises(ValueError, match="allowed") as err:
        speed_options({"speed": True, **override})
    assert named in str(err.value) and "\n" not in str(err.value)


def test_smoke_runs_do_not_time_and_full_runs_do(tmp_path):
    assert compose_train(tmp_path, "experiment=smoke").report.speed is False
    full = speed_options(compose_train(tmp_path).report)
    # the default predicts its latency at one thread (pruning.workload.threads): it is measured at one too
    assert full == SpeedOptions(speed=True, batches=(1, 32), source_tokens=32, new_tokens=32, repeats=3, threads=1)
    assert speed_options(compose_train(tmp_path, "pruning.workload.threads=2").report).threads == 2
    assert speed_options(compose_train(tmp_path, "pruning=l0").report).threads is None  # no prediction: as torch is
    # a comparison times every method at one count, those with a workload (l0_budget, random) and those without
    for method in ("l0_budget_24", "michel", "random_1", "dense"):
        cfg = compose_train(tmp_path, "experiment=compare", f"+compare={method}")
        assert speed_options(cfg.report).threads == 1, method
    assert speed_options(None) == SpeedOptions()  # a config recorded before report existed


def test_a_workload_longer_than_the_positions_is_refused_before_training(tmp_path):
    from gatedprune.train import train

    with pytest.raises(ValueError, match=r"report.source_tokens=300 is longer than the model's 256 positions"):
        train(compose_train(tmp_path / "run", "experiment=smoke", "report.speed=true", "report.source_tokens=300"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_reports_the_measured_speed_up_of_what_it_ships(tmp_path):
    run = tmp_path / "run"
    # the default's method (every kind under a budget) in the smoke model; a parameter target, as a latency one
    # may be out of the smoke model's reach on a loaded machine
    proc = run_train(run, "pruning=speed", "pruning.target_latency=null", "pruning.target_params=0.6",
                     "report.speed=true", "report.batches=[1,2]", "report.repeats=1", "report.new_tokens=2",
                     "finetune.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    speed = metrics["speed"]
    assert speed["model"] == str(run / "pruned_finetuned")  # the shipped model is the fine-tuned one
    assert list(speed["batches"]) == ["1", "2"]
    for cell in speed["batches"].values():
        assert all(cell[key] > 0 for key in ("dense_ms", "pruned_ms", "speed_up", "dense_cpu_ms", "pruned_cpu_ms",
                                             "cpu_speed_up"))
        assert cell["speed_up"] == pytest.approx(cell["dense_ms"] / cell["pruned_ms"])
    assert speed["params"] == {"dense": metrics["params_before"], "pruned": metrics["params"]}
    assert speed["file_bytes"]["pruned"] == (run / "pruned_finetuned" / "model.safetensors").stat().st_size
    assert "speed-up measured, wall (batch 1 / 2)" in proc.stdout
    assert "speed-up measured, CPU (batch 1 / 2)" in proc.stdout

    # the table from a hand-made report: the cost model's prediction beside the measured speed-up, and a run that
    # did not measure
    wall = " / ".join(f"{cell['speed_up']:.2f}x" for cell in speed["batches"].values())
    metrics["export"]["predicted"] = {"speed_up": 1.734, "latency": 0.58}
    table = final_table(metrics)
    measured = next(line for line in table.splitlines() if line.startswith("speed-up measured, wall"))
    assert measured.rstrip().endswith(wall)
    assert next(line for line in table.splitlines() if line.startswith("speed-up predicted")).rstrip().endswith("1.73x")
    # every row of the final table the README and the training-runs page show is a row of this run's table
    for page in (ROOT / "README.md", ROOT / "docs" / "guide" / "runs.md"):
        _rows_are_the_final_table_s(page.read_text(), table)
    metrics["speed"] = None
    table = final_table(metrics)
    assert "not measured (report.speed=false)" in table and "1.73x" in table and "speed-up measured, wall" not in table


def _rows_are_the_final_table_s(readme, table):
    block = readme[readme.index("This run ended at:"):].split("```text\n", 1)[1].split("```", 1)[0]
    printed = {line.split("  ")[0] for line in table.splitlines()}
    labels = [line.split("  ")[0].replace("(batch 1 / 32)", "(batch 1 / 2)") for line in block.splitlines()[1:]]
    assert labels and not set(labels) - printed, set(labels) - printed
