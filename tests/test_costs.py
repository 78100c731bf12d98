"""The cost model (gatedprune.costs): FLOPs against torch's counter, the latency fit against an injected fake timer
(never real timings), its cache and tables, and the gates' expected cost against the cost of the pruned model."""

from __future__ import annotations

import copy
import math
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FAKE_BASE, FAKE_COSTS, bart_structures, tiny_bart3
from gatedprune.costs import latency, table
from gatedprune.costs.build import latency_cost
from gatedprune.costs.counts import features
from gatedprune.costs.flops import count_flops, flops_cost
from gatedprune.costs.linear import LinearCost, StructureCosts
from gatedprune.costs.workload import Workload
from gatedprune.methods.budget import CostBudget, HeadBudget, resolve_targets
from gatedprune.methods.gated import L0Budget
from gatedprune.structures.adapters import probe
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.kinds import ALL_KINDS, LAYER_KINDS
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import prune_heads

WORKLOAD = Workload(source_tokens=7, target_tokens=5, batch=2, repeats=1)
# what the fake timer charges: seconds per structure of each kind, and per call (helpers' fake clock, with noise here)
TRUE, BASE = FAKE_COSTS, FAKE_BASE


def _mixed_plan(model, drop_decoder=(0,)) -> dict:
    """Some heads and units of every site, and decoder layers ``drop_decoder`` removed."""
    plan = {s.path: [i for i in range(s.num_units) if (i + s.layer) % 3]
            for s in structure_sites(model, [k for k in ALL_KINDS if k not in LAYER_KINDS])}
    for stack, path in probe(model).layers.items():
        dropped = drop_decoder if stack == "decoder" else ()
        plan[path] = [i for i in range(len(model.get_submodule(path))) if i not in dropped]
    return plan


def _generate(workload):
    def job(model):
        g = torch.Generator().manual_seed(0)
        src = torch.randint(3, model.config.vocab_size - 1, (workload.batch, workload.source_tokens), generator=g)
        with torch.no_grad():
            model.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=workload.num_beams,
                           do_sample=False, max_new_tokens=workload.target_tokens,
                           min_new_tokens=workload.target_tokens)
    return job


def fake_timer(noise: float = 0.0, seed: int = 0):
    """A timer that charges BASE + sum_k TRUE[k] n_k seconds, times (1 + noise * u), u uniform in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    calls = []

    def timer(models, workload):
        calls.append(len(models))
        out = []
        for model in models:
            n = bart_structures(model)
            exact = BASE + sum(TRUE[k] * n[k] for k in TRUE)
            out.append(exact * (1 + noise * (2 * torch.rand((), generator=g).item() - 1)))
        return out

    timer.calls = calls
    return timer


@pytest.fixture(scope="module")
def bart3():
    return tiny_bart3()


# ---- FLOPs --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mbart", "t5"])
@pytest.mark.parametrize("beams", [1, 3])
def test_flops_formula_counts_what_torch_counts_dense_and_pruned(model_of, family, beams):
    model = model_of(family)
    workload = Workload(source_tokens=7, target_tokens=5, batch=2, num_beams=beams)
    cost = flops_cost(model, workload)
    assert cost.of(model) == count_flops(_generate(workload), model)
    pruned = prune_heads(copy.deepcopy(model), _mixed_plan(model))
    assert cost.of(pruned) == count_flops(_generate(workload), pruned)  # the dense model's coefficients price it
    emptied = {s.path: [] for s in structure_sites(model, ["encoder", "cross"]) if s.layer == 0}
    pruned = prune_heads(copy.deepcopy(model), emptied)  # attention modules with no head keep a phantom one
    assert cost.of(pruned) == count_flops(_generate(workload), pruned)


def test_flops_of_grouped_query_attention_dense_model(model_of):
    model = model_of("t5gemma")
    assert flops_cost(model, WORKLOAD).of(model) == count_flops(_generate(WORKLOAD), model)


# ---- the latency fit --------------------------------------------------------------------------------------------
def test_fit_recovers_the_fake_timers_costs_and_predicts_other_plans(bart3):
    cost, probes = latency.fit_latency(bart3, WORKLOAD, fake_timer())
    assert cost.base == pytest.approx(BASE, rel=1e-6)
    for kind, value in TRUE.items():
        assert cost.coefficients[kind] == pytest.approx(value, rel=1e-6), kind
    names = [p["probe"] for p in probes]
    assert names[0] == "dense" and len(names) == 1 + 2 * len(ALL_KINDS) + 2  # each kind at 0.5 and 0, then all
    pruned = prune_heads(copy.deepcopy(bart3), _mixed_plan(bart3, drop_decoder=(1,)))
    n = bart_structures(pruned)
    assert cost.of(pruned) == pytest.approx(BASE + sum(TRUE[k] * n[k] for k in TRUE), rel=1e-6)
    # priced from counts alone (what a benchmark keeps of a probe), emptied attention modules at their phantom price
    assert cost.of_counts(n) == pytest.approx(cost.of(pruned), rel=1e-12)
    phantom = LinearCost("latency", BASE, TRUE, {"cross": 0.25})
    assert phantom.of_counts(n, {"cross": 2}) == pytest.approx(cost.of(pruned) + 0.5, rel=1e-12)


def test_fit_under_noise_predicts_within_its_noise(bart3):
    cost, _ = latency.fit_latency(bart3, WORKLOAD, fake_timer(noise=0.03))
    pruned = prune_heads(copy.deepcopy(bart3), _mixed_plan(bart3))
    n = bart_structures(pruned)
    assert cost.of(pruned) == pytest.approx(BASE + sum(TRUE[k] * n[k] for k in TRUE), rel=0.06)


def test_a_kind_that_costs_nothing_is_held_at_zero_not_negative():
    rows = [{k: 0 for k in ALL_KINDS} | {"encoder": e, "decoder": d} for e, d in [(8, 8), (4, 8), (0, 8), (8, 4), (8, 0)]]
    seconds = [1.0 + 0.1 * r["decoder"] - 0.001 * r["encoder"] for r in rows]  # encoder heads "save time": noise
    base, c = latency.fit(rows, seconds)
    assert c["encoder"] == 0.0 and c["decoder"] > 0 and base > 0
    assert all(c[k] == 0.0 for k in ALL_KINDS if k not in ("encoder", "decoder"))  # never varied: in the base


def test_probe_plans_shrink_each_kind_and_keep_a_decoder_layer(bart3):
    plans = dict(latency.probe_plans(bart3, (0.5, 0.0)))
    layers = probe(bart3).layers
    assert plans["decoder_layer 1/3"] == {layers["decoder"]: [0]}
    assert plans["encoder_layer 0/3"] == {layers["encoder"]: []}
    assert plans["encoder_layer 2/3"] == {layers["encoder"]: [0, 2]}
    assert all(v == [0, 1] for v in plans["cross 0.5"].values()) and len(plans["cross 0.5"]) == 3
    assert all(v == list(range(6)) for v in plans["decoder_ffn 0.5"].values())
    # every kind at once, per fraction: the union of that fraction's single-kind plans (no probe twice)
    widths = ("encoder", "decoder", "cross", "encoder_ffn", "decoder_ffn")
    for name, singles in (("every kind 0.5", [f"{k} 0.5" for k in widths] + ["encoder_layer 2/3", "decoder_layer 2/3"]),
                          ("every kind 0", [f"{k} 0" for k in widths] + ["encoder_layer 0/3", "decoder_layer 1/3"])):
        assert plans[name] == {path: kept for single in singles for path, kept in plans[single].items()}
    assert plans["every kind 0"][layers["encoder"]] == [] and plans["every kind 0"][layers["decoder"]] == [0]
    assert len(plans) == 1 + 14 + 2
    alone = dict(latency.probe_plans(bart3, (0.5, 0.0), joint=False))
    assert alone == {k: v for k, v in plans.items() if not k.startswith("every kind")}


def test_the_joint_probes_are_part_of_a_fits_key_and_one_kind_fits_keep_theirs(bart3):
    """A fit on the joint probes is cached under a key of its own; one on the probes of one kind each keeps the key
    such fits had before the joint probes (no field), so it is found again; a table from elsewhere matches a run
    whichever probes it was timed on."""
    on = table.key(bart3, WORKLOAD)
    off = table.key(bart3, Workload(**{**WORKLOAD.__dict__, "joint_probes": False}))
    assert on["workload"]["joint_probes"] is True and "joint_probes" not in off["workload"]
    assert {k: v for k, v in on["workload"].items() if k != "joint_probes"} == off["workload"]
    assert table.file_name(on) != table.file_name(off)
    table.check_match(Path("server.json"), off, on)
    table.check_match(Path("server.json"), on, off)
    with pytest.raises(ValueError, match="was measured for workload batch=2"):  # what is not how it was measured
        table.check_match(Path("server.json"), on, {**off, "workload": {**off["workload"], "batch": 3}})


def test_the_joint_probes_cut_as_their_plan_says(bart3):
    """Each probe that shrinks every kind at once keeps what its single-kind probes keep, all in one model (a site
    of a dropped layer skipped by the cut): it is counted as their sum."""
    models = dict(latency.probe_models(bart3, (0.5,)))
    dense, joint = features(models["dense"]), features(models["every kind 0.5"])
    singles = [features(m) for name, m in models.items() if name not in ("dense", "every kind 0.5")]
    # the heads and units left in kept layers: the layer probe keeps 2 of 3 layers, the width probes half of each
    for kind in ("encoder", "decoder", "cross", "encoder_ffn", "decoder_ffn"):
        half = min(row[kind] for row in singles)  # the width probe of this kind
        assert joint[kind] == half * 2 // 3, kind  # two of the three layers stay, each at half
    assert joint["encoder_layer"] == joint["decoder_layer"] == 2 and dense["encoder_layer"] == 3


def test_the_joint_probes_catch_a_time_that_does_not_add_up_by_kind(bart3, capsys):
    """A runtime whose time falls by more than the sum of each kind's saving when several kinds are cut at once
    (docs/gates.md 0h: CTranslate2 int8 at batch 32): a fit of probes that each cut one kind meets them exactly and
    is kept; with the joint probes the same fit misses them, is timed again to the last attempt and is not kept."""
    exact = fake_timer()
    dense = bart_structures(bart3)

    def interacting(models, workload):
        seconds = exact(models, workload)
        def narrowed(n):  # width kinds left narrower per layer than the dense model's (a dropped layer narrows none)
            stack = {"encoder": "encoder", "encoder_ffn": "encoder", "decoder": "decoder", "cross": "decoder",
                     "decoder_ffn": "decoder"}
            return sum(n[f"{stack[k]}_layer"] and n[k] * dense[f"{stack[k]}_layer"] < dense[k] * n[f"{stack[k]}_layer"]
                       for k in stack)

        return [s * (0.85 if narrowed(bart_structures(m)) > 1 else 1.0) for s, m in zip(seconds, models)]

    few = Workload(**{**WORKLOAD.__dict__, "fit_attempts": 2})
    _, probes = latency.fit_latency(bart3, Workload(**{**few.__dict__, "joint_probes": False}), interacting)
    assert latency.fit_error(probes) == pytest.approx(0, abs=1e-6)  # one-kind probes: no sign of it
    assert "timing the probes again" not in capsys.readouterr().out
    _, probes = latency.fit_latency(bart3, few, interacting)
    error = latency.fit_error(probes)
    assert few.keep_tolerance < error <= few.fit_tolerance  # seen: used for this run, not kept for later ones
    assert "timing the probes again (2 of 2)" in capsys.readouterr().out
    assert {p["probe"] for p in probes} >= {"every kind 0.5", "every kind 0"}


def _loaded(inflate: list[float]):
    """A timer whose i-th call charges the exact fake costs with probes 5 to 9 (cross-attention and encoder FFN)
    times ``inflate[i]``: a burst of load on a shared machine, falling on some probes of one timing."""
    exact, calls = fake_timer(), []

    def timer(models, workload):
        seconds = exact(models, workload)
        factor = inflate[len(calls)]
        calls.append([s * factor if 5 <= j <= 9 else s for j, s in enumerate(seconds)])
        return calls[-1]

    timer.calls = calls
    return timer


def test_one_loaded_timing_among_three_is_outvoted_by_the_median(bart3, capsys):
    timer = _loaded([2.0, 1.0, 1.0])
    cost, probes = latency.fit_latency(bart3, WORKLOAD, timer)
    # the loaded timing missed its probes by over 20%; the mean of two still does; the median of three is exact
    assert len(timer.calls) == 3
    out = capsys.readouterr().out
    assert "timing the probes again (2 of 15)" in out and "timing the probes again (3 of 15)" in out
    assert "(pruning.workload.keep_tolerance=0.05): timing the probes again" in out
    assert cost.base == pytest.approx(BASE, rel=1e-6)
    assert all(cost.coefficients[k] == pytest.approx(v, rel=1e-6) for k, v in TRUE.items())
    assert latency.fit_error(probes) == pytest.approx(0, abs=1e-6)
    assert [p["seconds"] for p in probes] == pytest.approx(timer.calls[1])  # the exact timing: the median
    assert [p["timings"] for p in probes] == [list(t) for t in zip(*timer.calls)]  # every timing, per probe


def test_a_fit_is_made_from_the_median_of_every_timing_so_far(bart3):
    timer = _loaded([1.6, 1.2])  # the second fit: the per-probe median of two timings, their mean
    # timed again beyond 20%, not 5%; the probes of one kind each (the loaded ones, 5 to 9, are two kinds': with the
    # joint probes, which cut those kinds too, the mean of two timings misses by more)
    loose = Workload(**{**WORKLOAD.__dict__, "keep_tolerance": 0.2, "joint_probes": False})
    cost, probes = latency.fit_latency(bart3, loose, timer)
    pooled = [(a + b) / 2 for a, b in zip(*timer.calls)]
    base, coefficients = latency.fit([p["structures"] for p in probes], pooled)  # refitted here
    assert len(timer.calls) == 2 and [p["seconds"] for p in probes] == pytest.approx(pooled)
    assert cost.base == pytest.approx(base) and cost.coefficients == pytest.approx(coefficients)
    assert WORKLOAD.keep_tolerance < latency.fit_error(probes) <= loose.keep_tolerance


def test_the_probes_are_timed_until_the_fit_meets_the_keep_tolerance_and_the_fit_is_then_kept(bart3, tmp_path,
                                                                                           machine_cache, capsys):
    """By default a fit is timed again while it misses a probe by more than 5% (``keep_tolerance``), up to 15
    timings; the first fit within it is returned and kept for later runs on this machine."""
    assert (Workload().fit_tolerance, Workload().keep_tolerance, Workload().fit_attempts) == (0.2, 0.05, 15)
    inflate = [1.3, 1.2, 1.0, 1.0, 1.0]  # a burst of load, then none: the median of n timings falls to 1.0
    timer = _loaded(inflate)
    rows = [features(m) for _, m in latency.probe_models(bart3, WORKLOAD.probe_fractions)]
    exact, errors = _exact(bart3), []
    for n in range(1, len(inflate) + 1):  # what the fit of the first n timings misses by, refitted here
        pooled = np.median([[s * f if 5 <= j <= 9 else s for j, s in enumerate(exact)] for f in inflate[:n]], axis=0)
        base, c = latency.fit(rows, pooled.tolist())
        errors.append(max(abs((base + sum(c[k] * r[k] for k in c)) / s - 1) for r, s in zip(rows, pooled)))
    first_within = next(n for n, e in enumerate(errors, 1) if e <= 0.05)
    assert errors[0] > 0.05 and first_within > 1  # the timer is off enough that timing again is needed
    cost, info = latency_cost(bart3, WORKLOAD, [tmp_path / "run"], timer)
    assert len(timer.calls) == first_within and info["fit_error"] == pytest.approx(errors[first_within - 1])
    assert (machine_cache / "latency" / Path(info["path"]).name).is_file()
    assert "note: this latency fit prices every later run" in capsys.readouterr().out


def test_a_fit_between_the_keep_and_fit_tolerances_prices_its_run_alone(bart3, tmp_path, machine_cache, capsys):
    """After its last timing a fit that misses a probe by more than ``keep_tolerance`` but within ``fit_tolerance``
    prices the run (and forks of its checkpoint, beside it) and is not kept in the machine's cache: the next run
    here times its own."""
    timer = _loaded([1.15] * 15)  # every timing loaded alike: the median never moves
    cost, info = latency_cost(bart3, WORKLOAD, [tmp_path / "run1"], timer)
    error = info["fit_error"]
    assert len(timer.calls) == 15 and 0.05 < error <= 0.2 and info["source"] == "measured"
    out = capsys.readouterr().out
    assert out.count("timing the probes again") == 14
    assert (f"note: after 15 timings this latency fit still misses its probes by {error:.1%}, more than "
            "pruning.workload.keep_tolerance=0.05: it prices this run (and forks of its checkpoint) but is not kept "
            "for later runs on this machine") in out and "note: this latency fit prices every later run" not in out
    assert info["path"] == str(tmp_path / "run1" / Path(info["path"]).name) and Path(info["path"]).is_file()
    assert not (machine_cache / "latency").exists() or not list((machine_cache / "latency").iterdir())
    # a fork of that checkpoint is priced by it; another run here times its own
    refused = lambda *a: pytest.fail("a fork reuses its checkpoint's fit")  # noqa: E731
    again, forked = latency_cost(bart3, WORKLOAD, [tmp_path / "fork", tmp_path / "run1"], refused)
    assert forked["source"] == "cache" and again == cost
    assert not (machine_cache / "latency").exists() or not list((machine_cache / "latency").iterdir())  # nor now
    exact = fake_timer()
    _, other = latency_cost(bart3, WORKLOAD, [tmp_path / "run2"], exact)
    assert other["source"] == "measured" and exact.calls == [17]


def _exact(model) -> list[float]:
    """The fake clock's seconds for each probe of ``model``."""
    return fake_timer()([m for _, m in latency.probe_models(model, WORKLOAD.probe_fractions)], WORKLOAD)


def test_a_machine_loaded_at_every_timing_refuses_to_fit_and_caches_nothing(bart3, tmp_path):
    timer = _loaded([2.0, 1.6, 2.5])
    three = Workload(**{**WORKLOAD.__dict__, "fit_attempts": 3})
    rows = [features(m) for _, m in latency.probe_models(bart3, WORKLOAD.probe_fractions)]
    with pytest.raises(latency.LatencyFitError) as caught:
        latency_cost(bart3, three, [tmp_path], timer)
    pooled = np.median(np.asarray(timer.calls), axis=0)  # what the last fit was made from, refitted here
    base, c = latency.fit(rows, pooled.tolist())
    errors = [abs((base + sum(c[k] * r[k] for k in c)) / s - 1) for r, s in zip(rows, pooled)]
    worst = latency.probe_plans(bart3, WORKLOAD.probe_fractions)[errors.index(max(errors))][0]
    assert len(timer.calls) == 3 and max(errors) > WORKLOAD.fit_tolerance
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        f"the latency fit misses its probe {worst!r} by {max(errors):.0%} after 3 timings of its probes "
        "(pruning.workload.fit_tolerance=0.2)")
    assert "pruning.workload.table=" in message and list(tmp_path.iterdir()) == []  # nothing cached
    assert not table.machine_dir().exists()  # nor in the machine's cache


def test_a_timer_that_returns_nonsense_is_refused(bart3):
    with pytest.raises(ValueError, match="every time must be a positive number"):
        latency.fit_latency(bart3, WORKLOAD, lambda models, w: [0.0] * len(models))


# ---- cache and tables -------------------------------------------------------------------------------------------
def test_latency_is_cached_beside_the_checkpoint_and_reused(bart3, tmp_path):
    timer = fake_timer()
    first, info = latency_cost(bart3, WORKLOAD, [tmp_path], timer)
    assert info["source"] == "measured" and timer.calls == [17]
    again, info = latency_cost(bart3, WORKLOAD, [tmp_path / "elsewhere", tmp_path], timer)  # a fork looks further
    assert info["source"] == "cache" and timer.calls == [17] and again == first
    _, info = latency_cost(bart3, Workload(**{**WORKLOAD.__dict__, "batch": 4}), [tmp_path], timer)
    assert info["source"] == "measured" and len(timer.calls) == 2  # another workload: its own fit
    assert len(list(tmp_path.glob("latency-*.json"))) == 2


def _skewed_timer():
    """The fake clock with a decoder layer 10 ms dearer: a second run on a machine under another load, whose fit
    (exact, as the clock is additive) prices the decoder layer otherwise."""
    plain = fake_timer()

    def timer(models, workload):
        return [t + 0.01 * bart_structures(m)["decoder_layer"] for t, m in zip(plain(models, workload), models)]

    timer.calls = plain.calls
    return timer


def test_a_fit_timed_here_prices_every_later_run_on_this_machine(bart3, tmp_path, machine_cache, capsys):
    first, info = latency_cost(bart3, WORKLOAD, [tmp_path / "run1"], fake_timer())
    kept = machine_cache / "latency" / Path(info["path"]).name
    assert info["source"] == "measured" and info["path"] == str(tmp_path / "run1" / kept.name) and kept.is_file()
    assert f"note: this latency fit prices every later run of this model's shapes and workload on this machine " \
           f"({kept}; delete it to time the probes again)" in capsys.readouterr().out
    # a second run in another directory, its machine under another load: the first run's fit, nothing timed
    skewed = _skewed_timer()
    again, info = latency_cost(bart3, WORKLOAD, [tmp_path / "run2"], skewed)
    assert skewed.calls == [] and again == first and info["source"] == "cache" and info["path"] == str(kept)
    assert f"latency fit: {kept}, timed earlier on this machine (" in capsys.readouterr().out
    assert table.read(tmp_path / "run2" / kept.name)[1] == first  # beside run2's checkpoints too: its forks reuse it
    # deleted, the probes are timed again: this run's own timings would have priced the decoder layer 10 ms dearer
    kept.unlink()
    fresh, info = latency_cost(bart3, WORKLOAD, [tmp_path / "run3"], skewed)
    assert info["source"] == "measured" and skewed.calls == [17] and kept.is_file()
    assert fresh.coefficients["decoder_layer"] == pytest.approx(first.coefficients["decoder_layer"] + 0.01)
    # another workload is another key: timed, not priced by this one
    _, info = latency_cost(bart3, Workload(**{**WORKLOAD.__dict__, "batch": 4}), [], skewed)
    assert info["source"] == "measured" and len(skewed.calls) == 2 and info["path"].startswith(str(kept.parent))


def test_the_machine_cache_times_again_what_it_cannot_trust(bart3, tmp_path, machine_cache, capsys):
    """A file in the machine's cache that does not read, or a fit looser than this run's tolerance, is timed again
    and replaced; a fit beside a checkpoint is kept in the machine's cache where it has none."""
    first, info = latency_cost(bart3, WORKLOAD, [], fake_timer())
    kept = Path(info["path"])
    kept.write_text("{")  # damaged
    timer = fake_timer()
    again, info = latency_cost(bart3, WORKLOAD, [], timer)
    assert info["source"] == "measured" and timer.calls == [17] and again == first
    assert f"note: {kept} is not a latency fit gatedprune can read (" in capsys.readouterr().out
    saved = json.loads(kept.read_text())
    saved["probes"][3]["seconds"] = saved["probes"][3]["predicted"] / 1.1  # a fit 10% off its probes
    kept.write_text(json.dumps(saved))
    loose = Workload(**{**WORKLOAD.__dict__, "keep_tolerance": 0.2})
    _, info = latency_cost(bart3, loose, [], timer)  # within this run's tolerance: reused
    assert info["source"] == "cache" and timer.calls == [17]
    _, info = latency_cost(bart3, WORKLOAD, [], timer)  # the default keeps a fit within 5%: not part of the key
    assert info["source"] == "measured" and timer.calls == [17, 17] and info["path"] == str(kept)
    assert "misses its probes by up to 10.0%, above pruning.workload.keep_tolerance=0.05" in capsys.readouterr().out
    tight = Workload(**{**WORKLOAD.__dict__, "fit_tolerance": 0.01})  # the stricter of the two is named
    assert tight.aim_setting == "pruning.workload.fit_tolerance=0.01" and WORKLOAD.aim == 0.05
    assert latency.fit_error(json.loads(kept.read_text())["probes"]) == pytest.approx(0, abs=1e-9)  # replaced
    # a fit beside a checkpoint, none in the machine's cache: reused, and kept there for the later runs
    kept.unlink()
    table.save(tmp_path / "ckpt" / kept.name, table.key(bart3, WORKLOAD), first, [])
    _, info = latency_cost(bart3, WORKLOAD, [tmp_path / "ckpt"], timer)
    assert info["source"] == "cache" and len(timer.calls) == 2 and table.read(kept)[1] == first
    assert f"latency fit: {tmp_path / 'ckpt' / kept.name}, kept beside the checkpoint (" in capsys.readouterr().out


def test_a_fit_that_cannot_be_kept_says_the_next_run_may_price_otherwise(bart3, tmp_path, monkeypatch, capsys):
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("GATEDPRUNE_CACHE", str(tmp_path / "a file"))  # a cache that cannot be made
    _, info = latency_cost(bart3, WORKLOAD, [], fake_timer())
    out = capsys.readouterr().out
    assert info["source"] == "measured" and info["path"] is None
    assert f"note: the latency fit is not cached in {tmp_path / 'a file' / 'latency'} (" in out
    assert "could not be kept for the next run" in out and "note: this latency fit prices" not in out


def test_the_machine_cache_is_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("GATEDPRUNE_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert table.machine_dir() == tmp_path / "mine" / "latency"
    monkeypatch.delenv("GATEDPRUNE_CACHE")
    assert table.machine_dir() == tmp_path / "xdg" / "gatedprune" / "latency"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert table.machine_dir() == tmp_path / "home" / ".cache" / "gatedprune" / "latency"


def test_a_table_from_another_machine_is_used_and_checked(bart3, tmp_path, capsys):
    cost, _ = latency_cost(bart3, WORKLOAD, [tmp_path], fake_timer())
    # a fit timed here says where it is kept for the next run, and how to give every machine one table
    assert "For one plan on every machine, measure a table once (gatedprune-latency" in capsys.readouterr().out
    (path,) = tmp_path.glob("latency-*.json")
    data = json.loads(path.read_text())
    data["key"]["device"] = "the user's server"
    data["key"]["workload"]["repeats"] = 9  # measured otherwise there: still the same workload
    server = tmp_path / "server.json"
    server.write_text(json.dumps(data))
    refused = lambda *a: pytest.fail("a table was given: nothing is timed")  # noqa: E731
    used, info = latency_cost(bart3, Workload(**{**WORKLOAD.__dict__, "table": str(server)}), [], refused)
    assert used == cost and info == {"source": "table", "path": str(server), "device": "the user's server",
                                     "fit_error": pytest.approx(0, abs=1e-9)}
    out = capsys.readouterr().out
    assert "note: this latency fit" not in out and "timed earlier" not in out  # a table is that one fit
    other = prune_heads(copy.deepcopy(bart3), {probe(bart3).layers["decoder"]: [0, 1]})
    with pytest.raises(ValueError, match=r"was measured for shapes structures=.*this run has .*allowed: a table"):
        latency_cost(other, Workload(**{**WORKLOAD.__dict__, "table": str(server)}), [], refused)
    server.write_text("{}")
    with pytest.raises(ValueError, match="not a gatedprune latency table"):
        table.read(server)


@pytest.mark.parametrize("bad, match", [
    ({"batch": 0}, r"pruning.workload.batch=0; allowed: an integer >= 1"),
    ({"runtime": "tensorrt"}, r"pruning.workload.runtime='tensorrt'; allowed: torch, ct2"),
    ({"probe_fractions": [1.0]}, r"probe_fractions=\[1.0\]; allowed: one or more fractions in \[0, 1\)"),
    ({"quantization": "int8"}, r"quantization='int8' with runtime torch"),
    ({"fit_tolerance": 0}, r"pruning.workload.fit_tolerance=0; allowed: a fraction > 0"),
    ({"keep_tolerance": -0.1}, r"pruning.workload.keep_tolerance=-0.1; allowed: a fraction > 0"),
    ({"joint_probes": "yes"}, r"pruning.workload.joint_probes='yes'; allowed: true or false"),
    ({"fit_attempts": 0}, r"pruning.workload.fit_attempts=0; allowed: an integer >= 1"),
    ({"beams": 4}, r"unknown key\(s\) \['beams'\]"),
])
def test_bad_workloads_are_refused_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        Workload.of(bad)


# ---- the gates' expected cost and the budget --------------------------------------------------------------------
def test_expected_cost_of_fixed_gates_is_the_cost_of_the_pruned_model(bart3):
    model = copy.deepcopy(bart3)
    cost = LinearCost("latency", BASE, TRUE)
    gates = attach_gates(model, ALL_KINDS)
    try:
        costs = StructureCosts.of_linear(cost, model, gates)
        assert costs.total == pytest.approx(BASE + sum(TRUE[k] * n for k, n in bart_structures(model).items()))
        plan = _mixed_plan(model, drop_decoder=(2,))
        gates.fix_(plan)  # log_alpha +-10: P(open) within 1e-4 of 0 or 1
        expected = costs.total - costs.prunable + costs.expected(gates).item()
        pruned = prune_heads(copy.deepcopy(bart3), plan)
        assert expected == pytest.approx(cost.of(pruned), rel=1e-3)
        # the floor: every gated structure removed but a decoder layer (every kind is gated: its own cost alone)
        assert costs.floor == pytest.approx((BASE + TRUE["decoder_layer"]) / costs.total)
    finally:
        gates.remove()


def _random_gates(model, kinds, seed: int):
    """Gates on ``kinds`` of ``model`` with log_alpha drawn from U(-3, 3): some open, some closed, some undecided."""
    gates = attach_gates(model, kinds)
    torch.manual_seed(seed)
    for gate in gates.gates:
        gate.log_alpha.data.uniform_(-3, 3)
    return gates


@pytest.mark.parametrize("kinds", [ALL_KINDS, ("encoder", "decoder", "cross", "decoder_layer")])
def test_the_export_rule_keeps_a_plan_within_the_target(bart3, kinds):
    model = copy.deepcopy(bart3)
    cost = LinearCost("latency", BASE, TRUE)
    gates = _random_gates(model, kinds, seed=1)
    try:
        gates.set_costs("latency", StructureCosts.of_linear(cost, model, gates))
        budget = CostBudget(gates, "latency", 0.6, warmup_steps=0)
        plan = gates.plan("latency", budget.kept_allowed)
        pruned = prune_heads(copy.deepcopy(bart3), plan)
        assert cost.of(pruned) <= 0.6 * cost.of(bart3) + 1e-12
        # nothing more fits: each structure left out would cost more than what is left of the budget
        left = 0.6 * cost.of(bart3) - cost.of(pruned)
        assert left < max(TRUE[k] for k in kinds) + max(TRUE[k] for k in ALL_KINDS if k not in kinds or k in LAYER_KINDS)
        budget(1).backward()  # differentiable in the gates
        assert all(g.log_alpha.grad is not None for g in gates.gates)
    finally:
        gates.remove()


@pytest.mark.parametrize("mode", ["binary", "expected_size"])
def test_without_the_fill_the_export_ships_the_eval_mode_mask_where_it_fits_and_fills_where_it_does_not(bart3, mode):
    """``pruning.export_fill=false`` (``CostBudget(ships=mode)``): the export is the gated model's own eval-mode mask
    when its cost is within the target, however far below; above the target, the most open structures that fit."""
    model = copy.deepcopy(bart3)
    cost = LinearCost("latency", BASE, TRUE)
    gates = _random_gates(model, ALL_KINDS, seed=4)
    try:
        gates.set_costs("latency", StructureCosts.of_linear(cost, model, gates))
        dense = cost.of(bart3)
        mask_cost = cost.of(prune_heads(copy.deepcopy(bart3), gates.plan(mode, note=False))) / dense
        floor = gates.costs["latency"].floor
        above, below = min(0.99, mask_cost + 0.05), max(floor, mask_cost - 0.05)  # targets around the mask's cost
        assert below < mask_cost < above
        roomy = CostBudget(gates, "latency", above, warmup_steps=0, ships=mode)
        assert roomy.export_rule() == (mode, None)
        report = roomy.report()["latency"]
        assert report["plan_rule"] == mode and report["plan_kept"] == pytest.approx(mask_cost, rel=1e-6)
        # the fill would have kept more: the most open structures up to the target
        filled = CostBudget(gates, "latency", above, warmup_steps=0)
        assert filled.export_rule() == ("latency", filled.kept_allowed)
        assert filled.report()["latency"]["plan_kept"] > mask_cost + 0.01
        tight = CostBudget(gates, "latency", below, warmup_steps=0, ships=mode)
        rule, allowed = tight.export_rule()
        assert rule == "latency" and allowed == pytest.approx(tight.kept_allowed)
        shipped = cost.of(prune_heads(copy.deepcopy(bart3), gates.plan(rule, allowed, note=False))) / dense
        assert shipped <= below + 1e-9 and tight.report()["latency"]["plan_kept"] == pytest.approx(shipped, rel=1e-6)
    finally:
        gates.remove()


@pytest.mark.parametrize("options, says", [
    (dict(target_latency=0.6, eval_gate_mode="deterministic"), "pruning.export_fill=false ships the eval-mode mask, "
     "and pruning.eval_gate_mode=deterministic is not a mask; allowed: eval_gate_mode in binary, expected_size, or "
     "export_fill=true"),
    (dict(target_heads=0.5, eval_gate_mode="expected_size"), "pruning.export_fill=false with a head budget (no cost "
     "target): it decides a cost budget's export; allowed: with target_params, target_flops or target_latency, or "
     "export_fill=true"),
])
def test_no_fill_is_refused_where_there_is_no_eval_mode_mask_of_a_cost_budget_to_ship(options, says):
    with pytest.raises(ValueError, match="^" + re.escape(says) + "$"):
        L0Budget(export_fill=False, kinds=list(ALL_KINDS), **options)
    with pytest.raises(ValueError, match=r"^pruning.export_fill='no'; allowed: true or false$"):
        L0Budget(export_fill="no", target_latency=0.6)


@pytest.mark.parametrize("ceiling", [False, True])
def test_a_ceiling_keeps_the_cost_multiplier_at_or_above_zero_and_nothing_else(bart3, ceiling):
    """``pruning.target_ceiling``: after each step the cost's lambda1 goes back to >= 0 (a cost under the target
    then pushes no gate open); lambda2 and the gradients are the Lagrangian's as ever."""
    model = copy.deepcopy(bart3)
    gates = _random_gates(model, ALL_KINDS, seed=3)
    try:
        gates.set_costs("latency", StructureCosts.of_linear(LinearCost("latency", BASE, TRUE), model, gates))
        budget = CostBudget(gates, "latency", 0.95, warmup_steps=0, ceiling=ceiling)
        with torch.no_grad():
            budget.lambda1.fill_(-2.0)
            budget.lambda2.fill_(-1.0)
        budget(1).backward()
        gap = (budget.expected_fraction() - 0.95).detach()
        assert gap.item() < 0  # under the target: the ascent lowers lambda1 further
        torch.testing.assert_close(budget.lambda1.grad, -gap)  # negated: ascent, with or without the ceiling
        budget.project_()
        assert budget.lambda1.tolist() == ([0.0] if ceiling else [-2.0]) and budget.lambda2.tolist() == [-1.0]
        with torch.no_grad():
            budget.lambda1.fill_(3.0)
        budget.project_()
        assert budget.lambda1.tolist() == [3.0]  # above zero: left as it is
        # with the layers of a kind tied (uniform_heads): the ties are equalities, their multipliers stay below zero
        tied = CostBudget(gates.set_uniform(heads=True), "latency", 0.95, warmup_steps=0, ceiling=ceiling)
        ties = sum(len(sites) for sites in tied.ties)
        assert ties > 0 and tied.lambda1.shape == (1 + ties,)
        with torch.no_grad():
            tied.lambda1.fill_(-2.0)
        tied.project_()
        assert tied.lambda1.tolist() == ([0.0] if ceiling else [-2.0]) + [-2.0] * ties
        # the logged lambda1 is the cost's alone, not summed with the ties'
        method = L0Budget(target_latency=0.95)
        assert method.penalty(gates, tied, 1)[1]["train/lambda1"].item() == tied.lambda1[0].item()
        # a head budget per kind: its two groups' multipliers summed, the ties' after them left out
        heads = HeadBudget(gates, resolve_targets({"encoder": 0.5, "decoder": 0.5}, gates), warmup_steps=0)
        assert len(heads.lambda1) > 2
        with torch.no_grad():
            heads.lambda1.copy_(torch.arange(len(heads.lambda1), dtype=torch.float32) + 1)
        assert method.penalty(gates, heads, 1)[1]["train/lambda1"].item() == 1.0 + 2.0
    finally:
        gates.remove()
    with pytest.raises(ValueError, match=r"^pruning.target_ceiling='yes'; allowed: true or false$"):
        L0Budget(target_ceiling="yes", target_latency=0.6)
    with pytest.raises(ValueError, match=r"^pruning.target_ceiling=true with a head budget \(no cost target\)"):
        L0Budget(target_ceiling=True, target_heads=0.5)


@pytest.mark.parametrize("decoder", ["one layer open", "every layer closed"])
def test_the_budget_prices_the_deterministic_gates_and_the_export_plan_as_the_models_they_cut(bart3, decoder):
    """``CostBudget.report``: each deterministic mask's cost and the export plan's are those of the models they cut,
    also when every decoder layer gate is closed (the plan's floor reopens one, and so does the priced mask)."""
    model = copy.deepcopy(bart3)
    cost = LinearCost("latency", BASE, TRUE)
    gates = _random_gates(model, ALL_KINDS, seed=2)
    try:
        decoder_layers = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
        for i in decoder_layers:
            gates.gates[i].log_alpha.data.fill_(-1.0 - i / 10)  # closed under log_alpha > 0, P(open) about 0.4
        if decoder == "one layer open":
            gates.gates[decoder_layers[0]].log_alpha.data.fill_(2.0)
        gates.set_costs("latency", StructureCosts.of_linear(cost, model, gates))
        budget = CostBudget(gates, "latency", 0.6, warmup_steps=0)
        report = budget.report()["latency"]
        dense = cost.of(bart3)
        for key, plan in (("binary_kept", gates.plan("binary", note=False)),
                          ("expected_size_kept", gates.plan("expected_size", note=False)),
                          ("plan_kept", gates.plan("latency", budget.kept_allowed, note=False))):
            pruned = prune_heads(copy.deepcopy(bart3), plan)
            assert report[key] == pytest.approx(cost.of(pruned) / dense, rel=1e-6), key
            assert len(plan[probe(bart3).layers["decoder"]]) >= 1, key
        assert report["plan_kept"] <= 0.6 + 1e-9 and report["binary_kept"] != pytest.approx(report["plan_kept"])
        assert report["expected_kept"] == pytest.approx(budget.expected_fraction().item())
    finally:
        gates.remove()


PHANTOM = {"encoder": 7e-4, "decoder": 9e-4, "cross": 8e-4}  # what an attention module emptied of heads costs


@pytest.mark.parametrize("layers, kept", [({}, {"decoder_layer": 1}), ({"decoder": 2}, {"decoder_layer": 2}),
                                           ({"encoder": 1}, {"decoder_layer": 1, "encoder_layer": 1}),
                                           ({"decoder": 3, "encoder": 2}, {"decoder_layer": 3, "encoder_layer": 2})])
def test_the_floor_with_a_depth_is_those_layers_alone_every_gated_structure_inside_removed(bart3, layers, kept):
    """Every kind gated: what is left is the base, each kept layer's own cost, and the phantom head of each attention
    module inside it (self-attention in an encoder layer; self- and cross-attention in a decoder layer); a stack not
    named keeps what the floor keeps (the decoder one layer, the encoder none)."""
    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ALL_KINDS)
    try:
        costs = StructureCosts.of_linear(LinearCost("latency", BASE, TRUE, PHANTOM), model, gates)
        inside = {"encoder_layer": PHANTOM["encoder"], "decoder_layer": PHANTOM["decoder"] + PHANTOM["cross"]}
        expected = (BASE + sum((TRUE[kind] + inside[kind]) * n for kind, n in kept.items())) / costs.total
        assert costs.floor_with(gates, layers) == pytest.approx(expected)
        assert costs.floor_with(gates, {}) == pytest.approx(costs.floor)
    finally:
        gates.remove()


def test_a_settled_depth_over_the_latency_target_is_refused_with_what_it_keeps(bart3):
    from gatedprune.costs.linear import shown_fraction
    from gatedprune.methods.settling import check_depth_fits

    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ALL_KINDS)
    try:
        gates.set_costs("latency", StructureCosts.of_linear(LinearCost("latency", BASE, TRUE), model, gates))
        two = (BASE + 2 * TRUE["decoder_layer"]) / gates.costs["latency"].total
        budget = CostBudget(gates, "latency", round(two - 0.002, 4), warmup_steps=0)
        with pytest.raises(ValueError, match=r"^pruning.settle_depth=\{'decoder': 2\} keeps at least ([0-9.]+) of the "
                                             r"dense model's predicted latency \(those layers alone, every other gated "
                                             r"structure removed\), above pruning.target_latency=[0-9.]+; allowed: "
                                             r"\{'decoder': 1\} \(the deepest that fits\), or a target of at "
                                             r"least \1$") as refused:
            check_depth_fits({"decoder": 2}, gates, budget)
        assert two <= float(refused.value.args[0].split("at least ")[1].split(" ")[0]) < two + 1e-4
        check_depth_fits({"decoder": 1}, gates, budget)  # one layer fits
        # two stacks: the deepest depth that fits is named, the deeper encoder first on a tie; under one layer each,
        # none is
        floor_with = gates.costs["latency"].floor_with
        assert floor_with(gates, {"encoder": 2, "decoder": 2}) > floor_with(gates, {"encoder": 2, "decoder": 1})
        between = CostBudget(gates, "latency", shown_fraction(floor_with(gates, {"encoder": 2, "decoder": 1})),
                             warmup_steps=0)
        with pytest.raises(ValueError, match=r"allowed: \{'encoder': 2, 'decoder': 1\} \(the deepest that fits\)"):
            check_depth_fits({"encoder": 2, "decoder": 2}, gates, between)
        # a target both three-layer depths fit (a decoder layer costs more than an encoder layer): the tie goes to the
        # deeper first stack as written, either way round
        tie = CostBudget(gates, "latency", shown_fraction(floor_with(gates, {"encoder": 1, "decoder": 2})),
                         warmup_steps=0)
        assert (floor_with(gates, {"encoder": 2, "decoder": 1}) < tie.target
                < floor_with(gates, {"encoder": 2, "decoder": 2}))
        with pytest.raises(ValueError, match=r"allowed: \{'encoder': 2, 'decoder': 1\} \(the deepest that fits\)"):
            check_depth_fits({"encoder": 2, "decoder": 2}, gates, tie)
        with pytest.raises(ValueError, match=r"allowed: \{'decoder': 2, 'encoder': 1\} \(the deepest that fits\)"):
            check_depth_fits({"decoder": 2, "encoder": 2}, gates, tie)
        under_one = CostBudget(gates, "latency", round(floor_with(gates, {"encoder": 1, "decoder": 1}) - 0.002, 4),
                               warmup_steps=0)
        one_each = shown_fraction(floor_with(gates, {"encoder": 1, "decoder": 1}))
        with pytest.raises(ValueError, match=rf"allowed: fewer stacks named \(one layer in each keeps at least "
                                             rf"{one_each}\), or a target of at least "):
            check_depth_fits({"encoder": 2, "decoder": 2}, gates, under_one)
        check_depth_fits({"decoder": 2}, gates, CostBudget(gates, "latency", math.ceil(two * 1e4) / 1e4, warmup_steps=0))
    finally:
        gates.remove()


def test_a_latency_target_below_the_floor_is_refused_with_the_floor(bart3):
    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ("encoder", "decoder", "cross"))
    try:
        gates.set_costs("latency", StructureCosts.of_linear(LinearCost("latency", BASE, TRUE), model, gates))
        floor = gates.costs["latency"].floor
        with pytest.raises(ValueError, match=r"pruning.target_latency=0.01 is below what removing every gated "
                                             r"structure reaches \(([0-9.]+) of the dense model's predicted "
                                             r"latency\); allowed: a fraction in \[\1, 1\)") as refused:
            CostBudget(gates, "latency", 0.01, warmup_steps=0)
        shown = float(re.search(r"\(([0-9.]+) of", str(refused.value)).group(1))
        assert floor <= shown < floor + 1e-4  # rounded up: the value shown is allowed
        CostBudget(gates, "latency", shown, warmup_steps=0)
    finally:
        gates.remove()


def test_one_target_per_run(bart3):
    with pytest.raises(ValueError, match=r"pruning.target_heads=3 and pruning.target_latency=0.5: a budget takes one"):
        L0Budget(target_heads=3, target_latency=0.5)
    with pytest.raises(ValueError, match=r"pruning.target_flops=1.5; allowed: a fraction in \(0, 1\)"):
        L0Budget(target_flops=1.5)
    assert L0Budget(target_flops=0.5).cost_unit == "flops" and L0Budget().target_heads == 0.5
    with pytest.raises(ValueError, match=r"pruning.workload.table=t.json is a latency fit, which only "
                                         r"pruning.target_latency uses"):
        L0Budget(target_flops=0.5, workload={"table": "t.json"})


def test_gatedprune_latency_writes_a_table_a_run_elsewhere_takes(bart3, tmp_path, monkeypatch, capsys):
    from gatedprune.cli import latency_command
    from gatedprune.costs import timers

    bart3.save_pretrained(tmp_path / "model")
    monkeypatch.setitem(timers.TIMERS, "torch", fake_timer())  # the server's clock, here a fake one
    out = tmp_path / "server" / "table.json"
    args = [str(tmp_path / "model"), str(out), "--source-tokens", "7", "--target-tokens", "5", "--batch", "2",
            "--repeats", "1"]
    assert latency_command(args) == 0 and f"wrote {out}" in capsys.readouterr().out
    refused = lambda *a: pytest.fail("a table was given: nothing is timed")  # noqa: E731
    cost, info = latency_cost(bart3, Workload(**{**WORKLOAD.__dict__, "table": str(out)}), [], refused)
    assert info["source"] == "table" and cost.coefficients["decoder_layer"] == pytest.approx(TRUE["decoder_layer"])
    assert info["fit_error"] == pytest.approx(0, abs=1e-9)  # the probes it was fitted to travel with it
    assert latency_command([str(tmp_path / "model"), str(tmp_path / "bad.json"), "--num-beams", "0"]) == 2
    assert "error: --num-beams=0; allowed: an integer >= 1" in capsys.readouterr().err
    assert latency_command([str(tmp_path / "model"), str(tmp_path / "bad.json"), "--fit-tolerance", "0"]) == 2
    assert "error: --fit-tolerance=0.0; allowed: a fraction > 0" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


def test_gatedprune_latency_refuses_a_loaded_fit_naming_its_own_flags(bart3, tmp_path, monkeypatch, capsys):
    from gatedprune.cli import latency_command
    from gatedprune.costs import timers

    bart3.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # the save's own progress bar (shown unless an earlier test turned the bars off)
    monkeypatch.setitem(timers.TIMERS, "torch", _loaded([1.15, 1.15]))  # within a run's 20%, not a table's 5%
    out = tmp_path / "table.json"
    assert latency_command([str(tmp_path / "model"), str(out), "--repeats", "1", "--fit-attempts", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the latency fit misses its probe ")
    assert "after 2 timings of its probes (--fit-tolerance=0.05)" in err[0] and "(--fit-attempts)" in err[0]
    assert "pruning.workload" not in err[0] and not out.exists()
    # the same timings with a tolerance of 20% asked for: the first fit within it is written, nothing timed again
    timer = _loaded([1.15, 1.15])
    monkeypatch.setitem(timers.TIMERS, "torch", timer)
    assert latency_command([str(tmp_path / "model"), str(out), "--repeats", "1", "--fit-tolerance", "0.2"]) == 0
    assert len(timer.calls) == 1 and 0.05 < latency.fit_error(table.read(out)[2]) <= 0.2


def test_a_cached_fit_that_misses_its_probes_is_reused_with_a_warning(bart3, tmp_path, capsys):
    _, info = latency_cost(bart3, WORKLOAD, [tmp_path], fake_timer())
    path = Path(info["path"])
    saved = json.loads(path.read_text())
    saved["probes"][3]["seconds"] = saved["probes"][3]["predicted"] / 1.3  # timed 30% faster than the fit says
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    refused = lambda *a: pytest.fail("a cached fit is reused, not timed again")  # noqa: E731
    _, again = latency_cost(bart3, WORKLOAD, [tmp_path], refused)
    assert again["source"] == "cache" and again["fit_error"] == pytest.approx(0.3)
    assert f"warning: the latency fit {path} misses its probes by up to 30%" in capsys.readouterr().out


@pytest.mark.parametrize("unit, kinds", [("latency", ALL_KINDS), ("flops", ("encoder", "decoder", "cross")),
                                         ("flops", ALL_KINDS)])
def test_a_target_just_above_the_floor_is_met_by_the_export(bart3, unit, kinds):
    """What every plan keeps (a decoder layer, the phantom head of an emptied attention module) is in the floor, and
    the export pays for it: the pruned model's cost, priced on the model itself, stays within the target."""
    model = copy.deepcopy(bart3)
    cost = LinearCost("latency", BASE, TRUE) if unit == "latency" else flops_cost(model, WORKLOAD)
    gates = attach_gates(model, kinds)
    try:
        torch.manual_seed(2)
        for gate in gates.gates:
            gate.log_alpha.data.uniform_(-3, 3)
        gates.set_costs(unit, StructureCosts.of_linear(cost, model, gates))
        target = gates.costs[unit].floor + 1e-4
        budget = CostBudget(gates, unit, target, warmup_steps=0)
        pruned = prune_heads(copy.deepcopy(bart3), gates.plan(unit, budget.kept_allowed, note=False))
        assert cost.of(pruned) <= target * cost.of(bart3) * (1 + 1e-9)
    finally:
        gates.remove()


def test_the_ctranslate2_timer_times_each_model_converted(model_of):
    """runtime ct2: every model converted and timed in CTranslate2 (times are only checked to be there)."""
    pytest.importorskip("ctranslate2")
    from gatedprune.costs.timers import ct2_timer

    model = model_of("bart")
    pruned = prune_heads(copy.deepcopy(model), _mixed_plan(model))
    seconds = ct2_timer([model, pruned], Workload(source_tokens=5, target_tokens=3, runtime="ct2", repeats=1))
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
