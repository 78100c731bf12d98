"""pruning.settle_widths_at: every gate decided as the fill keeps it at that step and held, so the rest of the gated
phase trains the model that ships (gatedprune.methods.settling, docs/gates.md 0l)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from helpers import tiny_bart3
from gatedprune.costs.build import gate_costs
from gatedprune.costs.flops import count_flops
from gatedprune.costs.workload import Workload
from gatedprune.methods.budget import CostBudget
from gatedprune.methods.gated import L0Budget
from gatedprune.methods.settling import settle_layers, settle_widths
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.kinds import ALL_KINDS
from gatedprune.surgery.cut import prune_heads

WORKLOAD = Workload(source_tokens=6, target_tokens=4, batch=1, repeats=1)


@pytest.fixture(scope="module")
def bart3():
    return tiny_bart3()


def _generate(model):
    src = torch.full((WORKLOAD.batch, WORKLOAD.source_tokens), 5)
    model.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=WORKLOAD.target_tokens,
                   min_new_tokens=WORKLOAD.target_tokens, num_beams=1, do_sample=False)


def _gated(bart3, seed=7):
    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ALL_KINDS)
    generator = torch.Generator().manual_seed(seed)
    for gate in gates.gates:  # every gate undecided: log_alpha in (-3, 3)
        gate.log_alpha.data = torch.rand(gate.log_alpha.shape, generator=generator) * 6 - 3
    gate_costs("flops", model, gates, WORKLOAD)
    return model, gates


def _budget(gates, target):
    """The state L0Budget.build gives a FLOPs target, on the costs of the test's own workload."""
    return CostBudget(gates, "flops", target, warmup_steps=0)


def test_settled_widths_hold_the_fill_of_that_step_and_every_plan_is_then_that_model(bart3, capsys):
    model, gates = _gated(bart3)
    method = L0Budget(target_flops=0.6, kinds=list(ALL_KINDS), settle_layers_at=2, settle_depth={"decoder": 1},
                      settle_widths_at=5, eval_gate_mode="expected_size")
    try:
        costs, budget = gates.costs["flops"], _budget(gates, 0.6)
        method.before_step(gates, budget, 1)
        assert not gates.settled  # neither step reached
        method.before_step(gates, budget, 2)  # the layers first, then the fill around them
        layers = dict(gates.settled)
        assert len(layers) == 6 and sum(v[0] > 0 for k, v in layers.items() if ".decoder." in k) == 1
        fill = gates.plan("flops", costs.allowed(0.6), note=False)  # what the fill keeps before anything is held
        capsys.readouterr()
        method.before_step(gates, budget, 5)
        assert capsys.readouterr().out.count("every gate is settled and held as the fill keeps it") == 1
        assert set(gates.settled) == set(gates.paths) and {k: gates.settled[k] for k in layers} == layers
        assert all(abs(v) == 10.0 for gate in gates.gates for v in gate.log_alpha.tolist())
        for mode in ("binary", "expected_size"):  # the gated model validated is the fill, in either eval mode
            assert gates.plan(mode, note=False) == fill, mode
        assert gates.plan("flops", costs.allowed(0.6), note=False) == fill  # and the export ships it
        # held: a gated step that moves the gates is undone, and later steps decide nothing again
        with torch.no_grad():
            for gate in gates.gates:
                gate.log_alpha.add_(torch.randn(gate.log_alpha.shape) * 30)
        gates.clamp_()
        method.before_step(gates, budget, 6)
        assert gates.plan("binary", note=False) == fill and "settled" not in capsys.readouterr().out
        # what ships costs at most the target, as torch counts the FLOPs of the cut model
        gates.remove()
        kept = count_flops(_generate, prune_heads(copy.deepcopy(bart3).eval(), fill)) / count_flops(
            _generate, copy.deepcopy(bart3).eval())
        assert 0.5 < kept <= 0.6
    finally:
        gates.remove()


def test_a_layer_settled_open_that_the_fill_cannot_pay_for_is_dropped_and_said(bart3, capsys):
    """Every encoder layer settled open, then a target that one layer of the encoder alone cannot fit beside the
    decoder's: the held model is the fill, not the layers as they were settled (else it would keep layers whose every
    gate is closed, and the export would drop them)."""
    model, gates = _gated(bart3, seed=5)
    try:
        costs = gates.costs["flops"]
        target = (costs.floor + costs.floor_with(gates, {"encoder": 1})) / 2  # below any plan with an encoder layer
        encoder = [i for i, kind in enumerate(gates.kinds) if kind == "encoder_layer"]
        for i in encoder:
            gates.settled[gates.paths[i]] = [10.0]
        gates.clamp_()
        fill = gates.plan("flops", costs.allowed(target), note=False)
        assert fill["model.encoder.layers"] == []
        settle_widths(gates, 4, 4, _budget(gates, target))
        said = capsys.readouterr().out
        assert all(f"the fill of the target drops {gates.paths[i]}, settled open" in said for i in encoder)
        assert gates.plan("binary", note=False) == fill
        assert all(gates.settled[gates.paths[i]] == [-10.0] for i in encoder)
    finally:
        gates.remove()


def test_settled_widths_without_settled_layers_decide_the_layers_by_the_fill_too(bart3):
    model, gates = _gated(bart3, seed=3)
    try:
        fill = gates.plan("flops", gates.costs["flops"].allowed(0.7), note=False)
        method = L0Budget(target_flops=0.7, kinds=list(ALL_KINDS), settle_widths_at=3)
        method.before_step(gates, _budget(gates, 0.7), 3)
        assert set(gates.settled) == set(gates.paths) and gates.plan("binary", note=False) == fill
        settle_layers(gates, 1, None, gated_step=4)  # every layer gate is settled already: nothing moves
        assert gates.plan("binary", note=False) == fill
    finally:
        gates.remove()


@pytest.mark.parametrize("options, says", [
    (dict(settle_widths_at=0, target_latency=0.6), "pruning.settle_widths_at=0; allowed: null or an integer >= 1 "
     "(a gated step)"),
    (dict(settle_widths_at=True, target_latency=0.6), "pruning.settle_widths_at=True is not a number; allowed: "
     "numbers"),  # every numeric option's check, before this one's
    (dict(settle_widths_at=2.5, target_latency=0.6), "pruning.settle_widths_at=2.5; allowed: null or an integer "
     ">= 1 (a gated step)"),
    (dict(settle_widths_at=99, settle_layers_at=100, target_latency=0.6), "pruning.settle_widths_at=99 is before "
     "pruning.settle_layers_at=100: the widths are decided around settled layers; allowed: an integer >= 100, or "
     "null"),
    (dict(settle_widths_at=100, target_heads=0.5), "pruning.settle_widths_at=100 with a head budget (no cost "
     "target): it settles at a cost's plan; allowed: with target_params, target_flops or target_latency, or "
     "settle_widths_at=null"),
])
def test_a_widths_settling_step_the_run_cannot_use_is_refused_in_one_line(options, says):
    with pytest.raises(ValueError, match="^" + re.escape(says) + "$"):
        L0Budget(kinds=list(ALL_KINDS), **options)


def test_a_widths_settling_step_after_the_gated_phase_is_refused_with_the_steps_it_has():
    method = L0Budget(target_latency=0.6, kinds=list(ALL_KINDS), settle_widths_at=20, start_step=10)
    with pytest.raises(ValueError, match=r"^pruning.settle_widths_at=20 is not inside the gated phase \(20 steps: "
                                         r"trainer.max_steps=30 - pruning.start_step=10\); allowed: an integer in "
                                         r"\[1, 19\], or null, or a longer gated phase \(gated_steps\)$"):
        method.check_schedule(30)
    method.check_schedule(31)


def test_a_run_that_settles_its_widths_ships_the_model_it_validated(tmp_path):
    """The smoke model priced by the fake timer: layers settled at gated step 8, every other gate at 12 as the fill
    keeps it; the gated model validated after that is the export (the same plan, the same validation BLEU)."""
    from helpers import FAKE_TIMER, SMOKE_LATENCY, run_train
    from gatedprune.training.checkpoints import load_gated_checkpoint

    run = tmp_path / "run"
    proc = run_train(run, *SMOKE_LATENCY, "pruning.target_warmup_steps=5", "pruning.settle_layers_at=8",
                     "pruning.settle_widths_at=12", "pruning.eval_gate_mode=expected_size", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gated step 12: note: every gate is settled and held as the fill keeps it") == 1
    _, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
    assert set(gates.settled) == set(gates.paths)
    assert all(abs(v) == 10.0 for gate in gates.gates for v in gate.log_alpha.tolist())
    metrics = json.loads((run / "metrics.json").read_text())
    plan = gates.plan("binary", note=False)
    attention = {path for path, kind in zip(gates.paths, gates.kinds) if kind in ("encoder", "decoder", "cross")}
    assert len(attention) == 6 and metrics["plan"] == {path: plan[path] for path in attention}  # its heads
    assert metrics["gated"]["kept"] == metrics["kept"]  # the model validated is the one shipped
    assert metrics["gated"]["bleu"] == pytest.approx(metrics["bleu"], abs=1e-9)
    costs = metrics["budget"]["latency"]
    assert costs["plan_kept"] == pytest.approx(costs["binary_kept"]) == pytest.approx(costs["expected_size_kept"])
    assert costs["plan_kept"] <= 0.6 + 1e-9


def test_a_settled_gate_counts_its_decision_in_the_expected_size_not_its_p_open():
    """At log_alpha -10 a gate is still open with P about 1e-4 (Louizos et al.'s formula, beta 0.33): over 6,134
    closed units that sums to 0.61, which would round the expected size of 10 settled-open units up to 11."""
    import math

    import transformers

    from families import FAMILY_CONFIGS

    config = FAMILY_CONFIGS["bart"]()
    config.encoder_layers, config.encoder_ffn_dim = 3, 2048
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    gates = attach_gates(model, ["encoder_ffn"])
    try:
        open_ = {(0, 3), (0, 700), (1, 5), (1, 6), (1, 2047), (2, 0), (2, 1), (2, 2), (2, 3), (2, 1000)}
        for site, (path, gate) in enumerate(zip(gates.paths, gates.gates)):
            gates.settled[path] = [10.0 if (site, unit) in open_ else -10.0 for unit in range(gate.num_heads)]
        gates.clamp_()
        p_closed = 1 / (1 + math.exp(-(-10.0 - 0.33 * math.log(0.1 / 1.1))))
        assert 0.5 < (3 * 2048 - len(open_)) * p_closed < 1  # what P(open) summed would add: rounds up by one
        assert gates.expected_counts() == {"encoder_ffn": len(open_)}
        kept = gates.plan_mask("expected_size", note=False)
        assert {(site, unit) for site, mask in enumerate(kept) for unit in torch.nonzero(mask).flatten().tolist()} == open_
    finally:
        gates.remove()


def test_layers_and_widths_may_settle_at_one_step_the_layers_first(bart3):
    model, gates = _gated(bart3, seed=9)
    try:
        method = L0Budget(target_flops=0.6, kinds=list(ALL_KINDS), settle_layers_at=3, settle_depth={"decoder": 1},
                          settle_widths_at=3)
        method.before_step(gates, _budget(gates, 0.6), 3)
        decoder = [gates.settled[gates.paths[i]][0] for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
        assert sorted(decoder) == [-10.0, -10.0, 10.0]  # the depth given, then every width around it
        assert set(gates.settled) == set(gates.paths)
        # stop_when_stable counts the plan's stability only once it can no longer move: after the ramp and the widths
        assert method.settles_from() == 100 and L0Budget(target_latency=0.6, settle_widths_at=7).settles_from() == 100
        assert L0Budget(target_latency=0.6, settle_widths_at=200).settles_from() == 200
    finally:
        gates.remove()
