"""benchmarks/price_sensitivity.py (issue 38, item 3): the nudged tables, the bootstrap of the recorded timings against
fits made here from timings whose cost is known, and its page against the committed records."""

import json

import numpy as np
import pytest

from gatedprune.costs import table as costs_table
from gatedprune.costs.linear import LinearCost
from gatedprune.structures.kinds import ALL_KINDS
from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("price_sensitivity")


@pytest.fixture(scope="module")
def precision(bench):
    """The precision table and its numbers, made again from fit_spread's committed records (4,000 resamples each)."""
    return bench.precision_table()


def test_a_nudged_table_moves_one_price_and_keeps_the_rest(bench, tmp_path):
    key, kept, probes = costs_table.read(bench.recovery.TABLE)
    for kind, factor in (("cross", 1.01), ("base", 1.001)):
        saved, cost, saved_probes = costs_table.read(bench.nudged(kind, factor, tmp_path / f"{kind}.json"))
        assert saved == key and saved_probes == probes  # the same model and workload: a run takes it as the table
        assert cost.base == pytest.approx(kept.base * (factor if kind == "base" else 1), rel=1e-12)
        for k in ALL_KINDS:
            assert cost.coefficients[k] == pytest.approx(kept.coefficients[k] * (factor if k == kind else 1),
                                                         rel=1e-12)


def _record(cost: LinearCost, timings: int, noise: float, seed: int) -> dict:
    """A fit_spread record of the teacher's 17 probes whose times are ``cost``'s, each timing's times multiplied by
    lognormal noise of ``noise``."""
    real = json.loads((load_benchmark("fit_spread").RESULTS / "joint" / "quiet.json").read_text())
    rows = [p["structures"] for p in real["probes"]]
    rng = np.random.default_rng(seed)
    exact = np.asarray([cost.of_counts(row) for row in rows])
    times = exact * np.exp(noise * rng.standard_normal((timings, len(rows))))
    return {"probes": real["probes"], "timings": times.tolist(), "workload": {"repeats": 3}}


def test_timings_that_add_up_bootstrap_to_their_own_cost(bench):
    _, kept, _ = costs_table.read(bench.recovery.TABLE)
    record = _record(kept, timings=6, noise=0.0, seed=0)
    dense = record["probes"][0]["structures"]
    plans = {"half the decoder FFN": ({**dense, "decoder_ffn": dense["decoder_ffn"] // 2}, 1.2),
             "two decoder layers": ({**dense, "decoder_layer": 2}, 1.1)}
    found = bench.bootstrap(record, plans, draws=20)
    total = kept.of_counts(dense)
    for kind in ALL_KINDS:  # every resample is the same timings: one fit, the cost's own shares
        share = kept.coefficients[kind] * dense[kind] / total
        assert found["shares"][kind] == pytest.approx((share,) * 3, abs=1e-9)
    assert found["shares"]["base"] == pytest.approx((kept.base / total,) * 3, abs=1e-9)
    for name, (counts, _) in plans.items():
        assert found["speed"][name] == pytest.approx((total / kept.of_counts(counts),) * 3, rel=1e-9)
    assert found["width"] == pytest.approx([0, 0], abs=1e-9)


def test_the_interval_narrows_as_one_over_the_root_of_the_timings(bench):
    """What timings_for assumes: 16 times the timings, a quarter of the width (within what 400 resamples show)."""
    _, kept, _ = costs_table.read(bench.recovery.TABLE)
    dense = _record(kept, 1, 0.0, 0)["probes"][0]["structures"]
    plans = {"a plan": ({**dense, "decoder_ffn": 900, "cross": 9, "decoder_layer": 2}, 1.4)}
    few = bench.bootstrap(_record(kept, 15, 0.05, seed=1), plans)
    many = bench.bootstrap(_record(kept, 240, 0.05, seed=2), plans)
    assert 2.5 < few["width"][0] / many["width"][0] < 6.5
    truth = kept.of_counts(dense) / kept.of_counts(plans["a plan"][0])
    assert few["speed"]["a plan"][0] == pytest.approx(truth, rel=0.03)  # the fit to every timing: near the truth
    assert many["speed"]["a plan"][0] == pytest.approx(truth, rel=0.01)
    assert bench.timings_for(0.28, 15, 0.01) == 11760 and bench.timings_for(0.01, 15, 0.01) == 15
    record = {"timings": [[1.0, 2.0], [3.0, 2.0], [2.0, 5.0]], "workload": {"repeats": 3}}
    assert bench.seconds_per_timing(record) == pytest.approx(3 * (2.0 + 2.0))


def test_a_run_is_priced_by_its_nudged_table_and_recorded_against_the_reference(bench, tmp_path, monkeypatch):
    reference = json.loads((bench.plan_repro.RESULTS / f"{bench.REFERENCE}.json").read_text())
    called = []

    def fake_run(command, log, env=None):  # what train.py leaves: the run's metrics and its export's plan
        called.append((command, env))
        run = next(a.split("=", 1)[1] for a in command if a.startswith("hydra.run.dir="))
        pruned = bench.Path(run) / "pruned"
        pruned.mkdir(parents=True)
        (bench.Path(run) / "metrics.json").write_text(json.dumps(
            {"kept": {"decoder_layer": 2}, "costs": {"source": "table", "base": 0.1, "coefficients": {"cross": 1e-3}}}))
        heads = {site[len("heads "):]: kept for site, kept in reference["plan"].items() if site.startswith("heads ")}
        heads[next(iter(heads))] = heads[next(iter(heads))][:-1]  # one head fewer than the reference's plan
        units = {site[len("units "):]: kept for site, kept in reference["plan"].items() if site.startswith("units ")}
        layers = {site[len("layers "):]: kept for site, kept in reference["plan"].items()
                  if site.startswith("layers ")}
        (pruned / "export_report.json").write_text(json.dumps(
            {"plan": {"encoder": heads}, "plan_units": {"ffn": units}, "plan_layers": layers}))

    monkeypatch.setattr(bench.recovery, "_run", fake_run)
    record = bench.run_one("cross", 1.01, tmp_path / "runs", tmp_path / "results")
    assert bench.run_one("cross", 1.01, tmp_path / "runs", tmp_path / "results")["wall_s"] is None and len(called) == 1
    (command, env), = called  # a finished run is recorded again, not run again
    tables = [a for a in command if a.startswith("pruning.workload.table=")]
    assert tables == [f"pruning.workload.table={tmp_path / 'runs' / 'tables' / 'cross_x1.01.json'}"]
    assert "seed=1234" in command and "finetune.steps=0" in command and "gated_steps=300" in command
    assert env == {"GATEDPRUNE_CACHE": str(tmp_path / "runs" / "caches" / "cross_x1.01")}
    assert record["apart"] == 1 and record["kind"] == "cross" and record["factor"] == 1.01
    assert record["costs"] == {"source": "table", "base": 0.1, "coefficients": {"cross": 1e-3}}
    assert record["command"].startswith("GATEDPRUNE_CACHE=RUNS/caches/cross_x1.01 train.py ")
    assert json.loads((tmp_path / "results" / "cross_x1.01.json").read_text())["plan"] == record["plan"]


def test_the_page_is_the_committed_records(bench, precision):
    """docs/benchmarks/price_sensitivity/README.md: each nudge's distance recomputed from its plan and the reference's,
    each run priced by the kept table with exactly its one price moved, the control's plan the reference's, and the
    precision table made again from fit_spread's records."""
    readme = (bench.RESULTS / "README.md").read_text()
    reference = json.loads((bench.plan_repro.RESULTS / f"{bench.REFERENCE}.json").read_text())
    _, kept, _ = costs_table.read(bench.recovery.TABLE)
    records = {name: json.loads((bench.RESULTS / f"{name}.json").read_text())
               for name in (bench.name_of(*n) for n in bench.NUDGES)}
    for name, record in records.items():
        assert record["apart"] == bench.plan_repro.plan_difference(record["plan"], reference["plan"]), name
        kind, factor, costs = record["kind"], record["factor"], record["costs"]
        assert costs["source"] == "table"
        assert costs["base"] == pytest.approx(kept.base * (factor if kind == "base" else 1), rel=1e-12)
        for k in ALL_KINDS:
            assert costs["coefficients"][k] == pytest.approx(kept.coefficients[k] * (factor if k == kind else 1),
                                                             rel=1e-12), (name, k)
    assert records["base_x1"]["apart"] == 0  # today's code, given the kept table as it is, ships the reference's plan
    assert bench.nudge_table(bench.RESULTS) in readme
    assert precision[0] in readme


def test_the_pages_quote_the_records(bench, precision):
    """docs/gates.md 0c (and its status list) and the guide's speed_targets quote the nudges and the precision as the
    records and the resampling give them."""
    records = [json.loads((bench.RESULTS / f"{bench.name_of(*n)}.json").read_text()) for n in bench.NUDGES]
    one_pct = [r["apart"] for r in records if r["factor"] == 1.01]
    tenth = next(r["apart"] for r in records if r["factor"] == 1.001)
    tenfold = next(r["apart"] for r in records if r["factor"] == 1.1)
    table, found = precision
    half = {load: round(100 * f["half"]) for load, f in found.items()}
    interval = {load: tuple(round(100 * (v / f["bootstrap"]["price"][0] - 1)) for v in f["bootstrap"]["price"][1:])
                for load, f in found.items()}
    needed = sorted(round(f["needed"], -2) for f in found.values())
    hours = sorted(round(f["hours"]) for f in found.values())
    widths = sorted(round(100 * float(np.median(f["bootstrap"]["width"]))) for f in found.values())
    text = (bench.ROOT / "docs" / "gates.md").read_text()
    assert bench.nudge_table(bench.RESULTS) in text and table in text  # the tables as the README has them
    page = " ".join(text.split())
    section = page[page.index("**How precise a fit must be for one plan"):page.index("## 0h.")]
    assert (f"Moving one price by 1% moved the plan by {min(one_pct)}-{max(one_pct)} structures" in section
            and f"by 0.1% still {tenth}" in section and f"by 10% moved it by {tenfold}." in section)
    assert (f"known to {interval['busy'][0]:+d}%/{interval['busy'][1]:+d}% beside a busy core and "
            f"{interval['quiet'][0]:+d}%/{interval['quiet'][1]:+d}% alone (90% interval; half-widths "
            f"±{half['busy']}% and ±{half['quiet']}%)") in section
    assert f"an interval {widths[0]}-{widths[1]}% wide" in section
    assert f"about {needed[0]:,}-{needed[1]:,} timings" in section and f"{hours[0]}-{hours[1]} hours" in section
    halves = sorted(half.values())
    status = page[:page.index("## 0. ")]
    assert (f"by 1% moved the default's plan by {min(one_pct)}-{max(one_pct)} structures" in status
            and f"uncertain by ±{halves[0]}-{halves[1]}% (90%)" in status)
    guide = " ".join((bench.ROOT / "docs" / "guide" / "speed_targets.md").read_text().split())
    assert f"{min(one_pct)}-{max(one_pct)} structures (0.1%: by {tenth})" in guide
    assert f"uncertain by ±{halves[0]}-{halves[1]}%" in guide
