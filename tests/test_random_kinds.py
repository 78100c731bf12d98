"""``pruning=random`` with feed-forward units and layers: plans at parameter budgets, measured by cutting a copy of the
model; heads-only draws unchanged; Michel and A* refuse the kinds they cannot score."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from helpers import bart_structures, compose_train, error_line, fake_timer, run_train, train_dense

from gatedprune import load_pruned
from gatedprune.costs.build import gate_costs
from gatedprune.costs.flops import count_flops
from gatedprune.costs.timers import TIMERS
from gatedprune.costs.workload import Workload
from gatedprune.methods.baselines import AStar, Michel
from gatedprune.methods.random_draw import Random
from gatedprune.methods.random_draw import param_floor
from gatedprune.reports.sweep import summarise
from gatedprune.structures.head_gates import attach_gates, non_embedding_parameters
from gatedprune.structures.kinds import ALL_KINDS
from gatedprune.surgery.cut import count_parameters, prune_heads, removed_parameters
from gatedprune.train import train

HEADS = [(f"layer{layer}", head) for layer in range(3) for head in range(4)]
ALL = "[" + ",".join(ALL_KINDS) + "]"


class HeadsProbe:
    def __init__(self, heads):
        self.heads = list(heads)


def test_heads_only_draws_are_those_recorded_before_other_kinds_existed():
    # recorded with the code of before this change (Random(heads=[9, 0.5, 2], seed=s) on these 12 heads)
    recorded = {
        0: [[("layer0", 0), ("layer0", 2), ("layer0", 3), ("layer1", 0), ("layer1", 1), ("layer1", 3), ("layer2", 0),
             ("layer2", 1), ("layer2", 2)],
            [("layer0", 0), ("layer1", 0), ("layer1", 1), ("layer1", 3), ("layer2", 0), ("layer2", 1)],
            [("layer0", 0), ("layer2", 0)]],
        7: [[("layer0", 0), ("layer0", 3), ("layer1", 0), ("layer1", 1), ("layer1", 2), ("layer1", 3), ("layer2", 0),
             ("layer2", 1), ("layer2", 3)],
            [("layer0", 0), ("layer0", 3), ("layer1", 0), ("layer1", 1), ("layer1", 3), ("layer2", 1)],
            [("layer0", 3), ("layer1", 0)]],
    }
    for seed, kept in recorded.items():
        levels = Random(heads=[9, 0.5, 2], seed=seed).levels(HeadsProbe(HEADS))
        assert [level.kept for level in levels] == kept
        assert [level.name for level in levels] == ["009_heads", "006_heads", "002_heads"]
        assert all(level.plan is None and level.budget is None for level in levels)
    default = Random()  # the config's heads: null is the half of the heads it always was
    assert default.heads == 0.5 and default.params is None


def _gated(model_of, family: str, kinds=ALL_KINDS, ffn_group: int = 1):
    """The tiny model gated on ``kinds``, a gate-free copy of it to cut, and a probe of the gated one."""
    model = model_of(family)
    reference = copy.deepcopy(model)
    gates = attach_gates(model, kinds, ffn_group=ffn_group)
    return reference, SimpleNamespace(gates=gates, model=model, heads=None)


def _kept_by_cutting(reference, plan) -> tuple[int, torch.nn.Module]:
    """Non-embedding parameters a plan keeps, measured by cutting a copy (embeddings are never cut)."""
    cut = copy.deepcopy(reference)
    before = count_parameters(cut)
    prune_heads(cut, plan)
    return non_embedding_parameters(reference) - (before - count_parameters(cut)), cut


@pytest.mark.parametrize("family, ffn_group", [("bart", 1), ("t5", 1), ("umt5", 1), ("t5gemma", 1), ("mt5", 4)])
def test_a_drawn_plan_keeps_at_most_its_budget_and_as_much_of_it_as_a_fill_can(model_of, family, ffn_group):
    # t5: a position bias owned by the first layer moves when that layer goes; umt5: one owned by every layer;
    # t5gemma: grouped key/value heads; mt5: a gated feed-forward block, its units drawn 4 at a time
    reference, probe = _gated(model_of, family, ffn_group=ffn_group)
    total = non_embedding_parameters(reference)
    levels = Random(kinds=ALL_KINDS, params=[0.9, 0.6, 0.3, 0.15], seed=3).levels(probe)
    assert [level.budget for level in levels] == [0.9, 0.6, 0.3, 0.15]
    for level in levels:
        kept, cut = _kept_by_cutting(reference, level.plan)
        assert kept <= int(level.budget * total)
        assert level.info["non_embedding_params_kept"] == kept and level.info["params_kept"] == kept / total
        # as close as a greedy fill gets: nothing it left out (a head, a unit group, a layer) fits in what is left
        gates, dropped = probe.gates, probe.gates.dropped(level.plan)
        sites = {path: i for i, path in enumerate(gates.paths)}
        for path, kept_ in level.plan.items():
            if path in sites:
                i = sites[path]
                if (gates.stacks[i], gates.layers[i]) in dropped:
                    continue  # goes with its layer
                step = gates.group_sizes[i]
                size = gates.gates[i].num_heads * step
                assert len(kept_) % step == 0 and all(kept_[j] % step == 0 for j in range(0, len(kept_), step))
            else:  # a stack of layers
                step, size = 1, len(reference.get_submodule(path))
            if family == "t5gemma":
                break  # grouped key/value heads: a query head whose key/value head stays costs less than the fill
                # counts (a share of k and v), so the fill leaves room it does not know of
            for first in (u for u in range(0, size, step) if u not in kept_):
                bigger = {**level.plan, path: sorted([*kept_, *range(first, first + step)])}
                assert total - removed_parameters(reference, bigger) > int(level.budget * total), (path, first)
        assert len(cut.get_submodule(gates.layers_paths["decoder_layer"])) >= 1


def test_heads_and_units_of_a_dropped_layer_go_with_it(model_of):
    reference, probe = _gated(model_of, "bart")
    gates = probe.gates
    dropped_levels = []
    for seed in range(20):  # the first draws at a small budget that drop a layer
        for level in Random(kinds=ALL_KINDS, params=[0.3], seed=seed).levels(probe):
            if gates.dropped(level.plan):
                dropped_levels.append(level)
    assert dropped_levels
    for level in dropped_levels[:3]:
        _, cut = _kept_by_cutting(reference, level.plan)
        # the heads a level reports are those the cut model has: none from a dropped layer
        attention = [m for m in cut.modules() if hasattr(m, "q_proj") and hasattr(m, "out_proj")]
        assert level.heads == len(level.kept) == sum(m.q_proj.out_features // m.head_dim for m in attention)
        for stack, layer in gates.dropped(level.plan):
            inside = f"model.{stack}.layers.{layer}."
            assert not any(path.startswith(inside) for path, _ in level.kept)
        expected_layers = {s: len(level.plan[f"model.{s}.layers"]) for s in ("encoder", "decoder")}
        assert {s: len(cut.get_submodule(f"model.{s}.layers")) for s in expected_layers} == expected_layers
        assert level.info["alive"]["decoder_layer"] == expected_layers["decoder"] >= 1


def test_a_decoder_keeps_a_layer_at_the_smallest_budget(model_of):
    reference, probe = _gated(model_of, "bart")
    total = non_embedding_parameters(reference)
    floor = param_floor(probe.gates, probe.model)
    fraction = (floor + 1) / total
    (level,) = Random(kinds=ALL_KINDS, params=fraction, seed=0).levels(probe)
    kept, cut = _kept_by_cutting(reference, level.plan)
    assert kept <= floor + 1 and len(cut.model.decoder.layers) == 1 and len(cut.model.encoder.layers) == 0
    assert level.heads == 0
    with torch.no_grad():  # and the model left still decodes
        out = cut.generate(torch.tensor([[0, 5, 6, 2]]), max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 1
    module = SimpleNamespace(gates=probe.gates, model=probe.model, teacher=None)
    below = Random(kinds=ALL_KINDS, params=(floor - 40) / total)
    with pytest.raises(ValueError, match=r"is below what removing every gated structure reaches .*; allowed: "
                                         r"fractions in \[0\.\d+, 1\)"):
        below.prepare(module, None)


def test_draws_repeat_with_the_seed_and_differ_between_seeds(model_of):
    _, probe = _gated(model_of, "bart")
    first, again, other = (Random(kinds=ALL_KINDS, params=[0.7, 0.4], seed=seed).levels(probe) for seed in (5, 5, 6))
    assert [level.plan for level in first] == [level.plan for level in again]
    assert first[0].plan != other[0].plan
    log_alpha = probe.gates.log_alpha()
    Random(kinds=ALL_KINDS, params=0.5).levels(probe)
    assert torch.equal(probe.gates.log_alpha(), log_alpha)  # the draw borrows the gates' scores and gives them back


def test_heads_only_at_a_parameter_budget(model_of):
    reference, probe = _gated(model_of, "bart", kinds=("encoder", "decoder", "cross"))
    (level,) = Random(params=0.8, seed=1).levels(probe)
    kept, _ = _kept_by_cutting(reference, level.plan)
    assert kept <= int(0.8 * non_embedding_parameters(reference)) and set(level.plan) == set(probe.gates.paths)
    assert level.name == "params_0.8" and str(level) == "params 0.8"


WORKLOAD = Workload(source_tokens=6, target_tokens=4, batch=1, repeats=1)


def _generate(model):
    src = torch.randint(3, model.config.vocab_size - 1, (WORKLOAD.batch, WORKLOAD.source_tokens),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=WORKLOAD.target_tokens,
                       min_new_tokens=WORKLOAD.target_tokens, num_beams=1, do_sample=False)


def _cut(reference, plan):
    cut = copy.deepcopy(reference).eval()
    prune_heads(cut, plan)
    return cut


def test_a_flops_draw_keeps_at_most_its_budget_as_torch_counts_flops(model_of):
    reference, probe = _gated(model_of, "bart")
    gate_costs("flops", probe.model, probe.gates, WORKLOAD)
    floor = probe.gates.costs["flops"].floor
    budgets = [0.9, round(floor + (1 - floor) / 3, 4)]
    levels = Random(kinds=ALL_KINDS, flops=budgets, seed=2).levels(probe)
    assert [level.name for level in levels] == [f"flops_{b:g}" for b in budgets]
    dense = count_flops(_generate, reference.eval())
    for level in levels:
        measured = count_flops(_generate, _cut(reference, level.plan)) / dense  # torch's counter, not the formula
        assert measured <= level.budget and level.info["flops_kept"] == pytest.approx(measured, rel=1e-9)
        assert level.info["target_flops"] == level.budget
    assert levels[1].info["flops_kept"] < levels[0].info["flops_kept"]


def test_a_latency_draw_keeps_at_most_its_budget_of_the_fitted_latency(model_of, monkeypatch):
    reference, probe = _gated(model_of, "bart")
    gate_costs("latency", probe.model, probe.gates, WORKLOAD, timer=fake_timer)  # the fit recovers FAKE_COSTS exactly
    dense = fake_timer([reference], WORKLOAD)[0]
    for seed in range(3):
        for level in Random(kinds=ALL_KINDS, latency=[0.8, 0.45], seed=seed).levels(probe):
            cut = _cut(reference, level.plan)
            kept = fake_timer([cut], WORKLOAD)[0] / dense  # what the timer charges the cut model
            assert kept <= level.budget + 1e-9 and level.info["latency_kept"] == pytest.approx(kept)
            assert len(cut.model.decoder.layers) >= 1 and level.name == f"latency_{level.budget:g}"
    module = SimpleNamespace(gates=probe.gates, model=probe.model, teacher=None)
    monkeypatch.setitem(TIMERS, "torch", fake_timer)  # what prepare's fit times with
    with pytest.raises(ValueError, match=r"^pruning.latency=0.01 is below what removing every gated structure "
                                         r"reaches \(0\.\d+ of the dense model's predicted latency"):
        Random(kinds=ALL_KINDS, latency=0.01, workload=asdict(WORKLOAD)).prepare(module, None)


@pytest.mark.parametrize("method", [Michel, AStar])
def test_michel_and_astar_refuse_other_kinds_in_one_line(method):
    with pytest.raises(ValueError) as refused:
        method(kinds=["encoder", "encoder_ffn", "decoder_layer"])
    assert str(refused.value) == (f"pruning={method.name} scores attention heads only; allowed kinds: encoder, "
                                  "decoder, cross (pruning.kinds names encoder_ffn, decoder_layer)")


@pytest.mark.parametrize("settings, message", [
    ({"kinds": ALL_KINDS, "heads": 12}, ("pruning.heads=12 while pruning.kinds names encoder_ffn, decoder_ffn, "
                                         "encoder_layer, decoder_layer: random then draws every gated structure at "
                                         "cost budgets; allowed: pruning.heads=null and one of pruning.params, pruning.flops, pruning.latency=")),
    ({"heads": 12, "params": 0.5}, "pruning.heads=12 while pruning.params=0.5 is set"),
    ({"kinds": ALL_KINDS, "params": 1.5}, "pruning.params=1.5; allowed: one or more fractions in (0, 1)"),
    ({"kinds": ALL_KINDS, "latency": [0.5, 2]}, "pruning.latency=[0.5, 2]; allowed: one or more fractions in (0, 1) "
                                                "of the predicted latency kept"),
    ({"kinds": ALL_KINDS, "params": 0.5, "flops": 0.5}, "pruning.params=0.5 and pruning.flops=0.5: random draws at "
                                                        "one cost; allowed: one of them, the others null"),
    ({"heads": 12, "latency": 0.5}, "pruning.heads=12 while pruning.latency=0.5 is set"),
    ({"kinds": ALL_KINDS, "params": 0.5, "workload": {"table": "fit.json"}},
     "pruning.workload.table=fit.json is a latency fit, which only pruning.latency uses"),
    ({"kinds": ALL_KINDS, "params": []}, "pruning.params=[]; allowed: one or more fractions in (0, 1)"),
    ({"kinds": ALL_KINDS, "params": [0.5, 0.5]}, "pruning.params=[0.5, 0.5] names a budget twice"),
])
def test_bad_random_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError) as refused:
        Random(**settings)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_train_refuses_michel_with_other_kinds_in_one_line(tmp_path):
    proc = run_train(tmp_path / "run", "pruning=michel", "pruning.kinds=[encoder,decoder_ffn]")
    assert proc.returncode == 2
    assert ("pruning=michel scores attention heads only; allowed kinds: encoder, decoder, cross (pruning.kinds names "
            "decoder_ffn)") in error_line(proc)


def test_a_random_run_of_every_kind_exports_its_budgets_verified(tmp_path, capsys):
    dense = train_dense(tmp_path / "dense")
    out = tmp_path / "sweep" / "random"
    metrics = train(compose_train(out, "experiment=smoke", f"resume={dense}", "pruning=random", f"pruning.kinds={ALL}",
                                  "pruning.params=[0.7,0.4]"))
    assert [level["name"] for level in metrics["levels"]] == ["params_0.7", "params_0.4"]
    assert metrics["target_params"] == 0.4 and metrics["target_heads"] is None
    for level in metrics["levels"]:
        level_dir = out / "levels" / level["name"]
        level_metrics = json.loads((level_dir / "metrics.json").read_text())
        assert level_metrics["export"]["verification"]["passed"]
        assert set(level_metrics["export"]["units_kept"]) == {"encoder_ffn", "decoder_ffn"}
        assert set(level_metrics["export"]["layers_kept"]) == {"encoder_layer", "decoder_layer"}
        # measured on the export, reloaded: its non-embedding parameters against those of the model it was cut from
        pruned = load_pruned(level_dir / "pruned")
        assert count_parameters(pruned) == level_metrics["params"]
        kept = non_embedding_parameters(pruned)
        total = kept + level_metrics["params_before"] - level_metrics["params"]
        assert kept <= int(level["target_params"] * total) and kept == level["non_embedding_params_kept"]
        assert level_metrics["heads_alive"]["total"] == level["heads"]
    assert "params budget" in capsys.readouterr().out
    assert sorted(row["run"] for row in summarise(out.parent, tmp_path / "summary")) == [
        "random/levels/params_0.4", "random/levels/params_0.7"]
