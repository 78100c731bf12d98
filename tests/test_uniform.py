"""pruning.uniform_heads / uniform_ffn: every layer of a kind keeps the same count (the kind's kept total divided
evenly, the largest log_alpha of each layer), under every rule, with dropped layers; the budget ties the layers;
the methods that do not shape plans refuse the options; a train run exports the uniform plan."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from families import FAMILY_CONFIGS
from helpers import compose_train, run_train

from gatedprune import attach_gates
from gatedprune.methods.baselines import AStar, Michel
from gatedprune.methods.random_draw import Random
from gatedprune.methods.budget import CostBudget, HeadBudget
from gatedprune.methods.gated import L0, L0Budget
from gatedprune.structures.kinds import ATTENTION_KINDS, FFN_KINDS
from gatedprune.surgery.cut import removed_parameters

LAYERS, HEADS, FFN = 3, 4, 12


@pytest.fixture(scope="module")
def bart3():
    """A tiny BART with 3 + 3 layers (so counts do not divide evenly), 4 heads, FFN width 12."""
    config = FAMILY_CONFIGS["bart"]()
    config.encoder_layers = config.decoder_layers = LAYERS
    config.encoder_ffn_dim = config.decoder_ffn_dim = FFN
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


def _gates(model, kinds=ATTENTION_KINDS, seed=0, **options):
    """Gates with distinct random log_alpha, some above and some below 0."""
    gates = attach_gates(model, kinds, **options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in gates.gates:
            gate.log_alpha.copy_(torch.randn(gate.num_heads, generator=generator) * 2)
    return gates


def _sites(gates, kind):
    return [i for i, k in enumerate(gates.kinds) if k == kind]


def _top(gates, i, n, size=1):
    """The units of site i's ``n`` largest log_alpha gates (ties do not occur with random values)."""
    values = gates.gates[i].log_alpha.tolist()
    best = sorted(range(len(values)), key=lambda j: -values[j])[:n]
    return sorted(g * size + j for g in best for j in range(size))


def _count(total, layers, down=False):
    if total == 0:
        return 0
    return total // layers if down else max(1, round(total / layers))


def _positive(gates, i):
    return sum(v > 0 for v in gates.gates[i].log_alpha.tolist())


def test_uniform_heads_spreads_each_kinds_binary_total_evenly(bart3):
    gates = _gates(bart3)
    try:
        plain = gates.plan(note=False)
        assert plain == {gates.paths[i]: [j for j, v in enumerate(g.log_alpha.tolist()) if v > 0]
                         for i, g in enumerate(gates.gates)}  # off: the binary rule as before
        plan = gates.set_uniform(heads=True).plan(note=False)
        uneven = 0
        for kind in ATTENTION_KINDS:
            total = sum(_positive(gates, i) for i in _sites(gates, kind))
            n = _count(total, LAYERS)
            uneven += n * LAYERS != total
            assert {gates.paths[i]: plan[gates.paths[i]] for i in _sites(gates, kind)} == {
                gates.paths[i]: _top(gates, i, n) for i in _sites(gates, kind)}
        assert uneven  # the seed gives a kind whose total the layers do not divide: rounding was exercised
        assert gates.heads_alive() == gates.alive(plan)  # the reports count the same plan
    finally:
        gates.remove()


def test_uniform_heads_under_top_k_takes_the_rules_total_per_kind(bart3):
    gates = _gates(bart3, seed=1).set_uniform(heads=True)
    try:
        plan = gates.plan("top-k", {"encoder": 5, "cross": 0}, note=False)
        decoder = sum(_positive(gates, i) for i in _sites(gates, "decoder"))  # not named: the binary rule
        for kind, total in (("encoder", 5), ("cross", 0), ("decoder", decoder)):
            for i in _sites(gates, kind):
                assert plan[gates.paths[i]] == _top(gates, i, _count(total, LAYERS)), kind
        # one total over every kind: its split is the top-k's, each kind's share then spread
        scored = sorted((v, gates.kinds[i]) for i, g in enumerate(gates.gates) for v in g.log_alpha.tolist())
        share = {kind: sum(k == kind for _, k in scored[-7:]) for kind in ATTENTION_KINDS}
        plan = gates.plan("top-k", 7, note=False)
        for kind in ATTENTION_KINDS:
            assert {len(plan[gates.paths[i]]) for i in _sites(gates, kind)} == {_count(share[kind], LAYERS)}
    finally:
        gates.remove()


def test_uniform_ffn_spreads_each_stacks_width_in_groups(bart3):
    gates = _gates(bart3, ["encoder", *FFN_KINDS], seed=2, ffn_group=3).set_uniform(ffn=True)  # 4 gates of 3 units
    try:
        assert gates.uniform == FFN_KINDS
        plan = gates.plan(note=False)
        for i in _sites(gates, "encoder"):  # heads are not shaped
            assert plan[gates.paths[i]] == [j for j, v in enumerate(gates.gates[i].log_alpha.tolist()) if v > 0]
        for kind in FFN_KINDS:
            n = _count(sum(_positive(gates, i) for i in _sites(gates, kind)), LAYERS)
            for i in _sites(gates, kind):
                assert plan[gates.paths[i]] == _top(gates, i, n, size=3)
    finally:
        gates.remove()


def test_a_dropped_layer_does_not_count(bart3):
    gates = _gates(bart3, [*ATTENTION_KINDS, "encoder_ffn", "decoder_ffn", "decoder_layer"], seed=3)
    gates.set_uniform(heads=True, ffn=True)
    layer_gates = _sites(gates, "decoder_layer")
    try:
        with torch.no_grad():
            for i, value in zip(layer_gates, (5.0, -5.0, 5.0)):  # decoder layer 1 dropped
                gates.gates[i].log_alpha.fill_(value)
        plan = gates.plan(note=False)
        assert plan["model.decoder.layers"] == [0, 2]
        alive = gates.alive(plan)
        for kind in ("decoder", "cross", "decoder_ffn", "encoder", "encoder_ffn"):
            sites = _sites(gates, kind)
            present = [i for i in sites if kind.startswith("encoder") or gates.layers[i] != 1]
            n = _count(sum(_positive(gates, i) for i in present), len(present))
            for i in sites:  # the dropped layer's own gates are shaped too: the plan reads the same everywhere
                assert plan[gates.paths[i]] == _top(gates, i, n), kind
            assert alive[kind] == n * len(present)
        with torch.no_grad():  # every decoder layer closed: the most open one stays, and alone sets the count
            for i, value in zip(layer_gates, (-3.0, -5.0, -1.0)):
                gates.gates[i].log_alpha.fill_(value)
        plan = gates.plan(note=False)
        assert plan["model.decoder.layers"] == [2]
        last = [i for i in _sites(gates, "cross") if gates.layers[i] == 2]
        assert {len(plan[gates.paths[i]]) for i in _sites(gates, "cross")} == {_count(_positive(gates, last[0]), 1)}
    finally:
        gates.remove()


def test_under_the_params_rule_counts_round_down_and_the_budget_holds(bart3):
    gates = _gates(bart3, [*ATTENTION_KINDS, *FFN_KINDS], seed=4)
    try:
        allowed = gates.prunable_params // 2
        plain = gates.plan("params", allowed, note=False)
        totals = {kind: sum(len(plain[gates.paths[i]]) for i in _sites(gates, kind)) for kind in gates.heads_per_kind()
                  if kind != "total"}
        plan = gates.set_uniform(heads=True, ffn=True).plan("params", allowed, note=False)
        for kind, total in totals.items():
            for i in _sites(gates, kind):
                assert plan[gates.paths[i]] == _top(gates, i, _count(total, LAYERS, down=True)), kind
        assert gates.prunable_params - removed_parameters(bart3, plan) <= allowed
    finally:
        gates.remove()


def _p_open(gates, i):
    """P(open) of site i's gates from the hard-concrete formula (Louizos et al.).  # (G,)"""
    gamma, zeta = gates.options.stretch
    return torch.sigmoid(gates.gates[i].log_alpha - gates.options.temperature * math.log(-gamma / zeta))


def _tie_reference(gates, kinds):
    gaps = []
    for kind in kinds:
        s = torch.stack([_p_open(gates, i).mean() for i in _sites(gates, kind)])
        gaps += list(s - s.mean())
    return gaps


def test_a_head_budget_ties_the_layers_of_each_uniform_kind(bart3):
    gates = _gates(bart3, seed=5)
    try:
        assert HeadBudget(gates, {"encoder": 6}, warmup_steps=0).lambda1.numel() == 1  # off: one per group
        gates.set_uniform(heads=True)
        budget = HeadBudget(gates, {"encoder": 6, "cross": 3}, warmup_steps=0)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            budget.lambda1.copy_(torch.randn(2 + 3 * LAYERS, generator=generator))
            budget.lambda2.copy_(torch.rand(2 + 3 * LAYERS, generator=generator))
        heads = HEADS * LAYERS  # of each kind
        group = [sum(_p_open(gates, i).sum() for i in _sites(gates, kind)) / heads - target / heads
                 for kind, target in (("encoder", 6), ("cross", 3))]
        gap = torch.stack([*group, *_tie_reference(gates, ATTENTION_KINDS)]).detach()
        penalty = budget(10)
        torch.testing.assert_close(penalty, (budget.lambda1 * gap + budget.lambda2 * gap**2).sum())
        penalty.backward()
        torch.testing.assert_close(budget.lambda1.grad, -gap)  # ascent on every multiplier, the ties' too
    finally:
        gates.remove()


def test_a_parameter_budget_ties_the_feed_forward_layers(bart3):
    gates = _gates(bart3, FFN_KINDS, seed=6).set_uniform(ffn=True)
    try:
        unit = 2 * bart3.config.d_model + 1  # an FFN unit: its fc1 row and bias, its fc2 column
        assert gates.prunable_params == unit * FFN * 2 * LAYERS
        fixed = gates.non_embedding_params - gates.prunable_params
        target = 1 - 0.5 * gates.prunable_params / gates.non_embedding_params
        budget = CostBudget(gates, "params", target, warmup_steps=0)
        with torch.no_grad():
            budget.lambda1.copy_(torch.linspace(-1, 1, 1 + 2 * LAYERS))
            budget.lambda2.fill_(0.5)
        kept = fixed + unit * sum(_p_open(gates, i).sum() for i in range(len(gates.gates)))
        gap = torch.stack([kept / gates.non_embedding_params - target, *_tie_reference(gates, FFN_KINDS)]).detach()
        torch.testing.assert_close(budget(5), (budget.lambda1 * gap + budget.lambda2 * gap**2).sum())
    finally:
        gates.remove()


def test_l0_budget_shapes_its_gates_and_says_what_an_uneven_target_keeps(bart3, capsys):
    gates = attach_gates(bart3)
    try:
        method = L0Budget(uniform_heads=True, target_heads={"encoder": 5, "cross": 6})
        budget = method.build(gates, bart3)
        assert gates.uniform == ATTENTION_KINDS and budget.lambda1.numel() == 2 + 3 * LAYERS
        out = capsys.readouterr().out
        assert "target_heads=5 for encoder over its 3 layers: uniform_heads keeps 2 per layer (6 heads)" in out
        assert "for cross" not in out  # 6 over 3 layers: met exactly
        L0().build(gates, bart3)
        assert gates.uniform == ()  # off: every plan as the rule keeps it
    finally:
        gates.remove()


@pytest.mark.parametrize("make, message", [
    (lambda: Michel(uniform_heads=True), r"^pruning.uniform_heads=true: pruning=michel does not shape its plans"),
    (lambda: AStar(uniform_ffn=True), r"^pruning.uniform_ffn=true: pruning=astar does not shape its plans"),
    (lambda: Random(uniform_heads=True), r"^pruning.uniform_heads=true: pruning=random does not shape its plans"),
    (lambda: L0(uniform_ffn=True), (r"^pruning.uniform_ffn=true with pruning.kinds=\['encoder', 'decoder', 'cross'\], "
                                    r"which gates no feed-forward kind; allowed: false, or one of encoder_ffn")),
    (lambda: L0(kinds=["encoder_ffn"], uniform_heads=True), r"gates no attention kind"),
    (lambda: L0(uniform_heads="yes"), r"^pruning.uniform_heads='yes'; allowed: true or false$"),
])
def test_bad_uniform_settings_are_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message) as error:
        make()
    assert "\n" not in str(error.value)


def test_the_options_reach_every_method_from_the_config(tmp_path):
    from gatedprune.train import _instantiate

    method = _instantiate(compose_train(tmp_path, "pruning=l0_budget", "pruning.uniform_heads=true").pruning)
    assert method.uniform_heads and not method.uniform_ffn
    with pytest.raises(ValueError, match=r"^pruning.uniform_ffn=true: pruning=random does not"):
        _instantiate(compose_train(tmp_path, "pruning=random", "pruning.uniform_ffn=true").pruning)


def test_a_budgeted_run_with_uniform_heads_exports_one_count_per_layer(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.uniform_heads=true", "pruning.target_heads={encoder:5,cross:6}",
                     "model.from_scratch.encoder_layers=3", "model.from_scratch.decoder_layers=3",
                     "pruning.target_warmup_steps=5", "pruning.gate_lr=0.5", "trainer.max_steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    assert report["verification"]["passed"]
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    layout = state["gates._extra_state"]
    log_alpha = [state[f"gates.gates.{i}.log_alpha"] for i in range(len(layout["paths"]))]
    for kind, total in (("encoder", 5), ("cross", 6), ("decoder", None)):
        sites = [i for i, k in enumerate(layout["kinds"]) if k == kind]
        if total is None:  # no target: the binary rule's total
            total = sum(int((log_alpha[i] > 0).sum()) for i in sites)
        n = _count(total, LAYERS)
        expected = {layout["paths"][i]: sorted(torch.argsort(log_alpha[i], descending=True, stable=True)[:n].tolist())
                    for i in sites}
        assert report["plan"][kind] == expected, kind


@pytest.mark.parametrize("uniform", [False, True])
def test_a_per_kind_top_k_is_not_spent_inside_a_dropped_layer(uniform):
    """Three decoder layers, the middle one's layer gate closed, cross log_alpha (3, 2.9, 2.8, -3) in each: top-k
    with 6 cross heads ships 6, all in the two layers that stay (3 each); a head ranks no higher than its layer."""
    config = FAMILY_CONFIGS["bart"]()
    config.decoder_layers = 3
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    gates = attach_gates(model, ["cross", "decoder_layer"]).set_uniform(heads=uniform)
    with torch.no_grad():
        for i, gate in enumerate(gates.gates):
            if gates.kinds[i] == "cross":
                gate.log_alpha.copy_(torch.tensor([3.0, 2.9, 2.8, -3.0]))
            else:
                gate.log_alpha.fill_(-5.0 if gates.layers[i] == 1 else 5.0)
    plan = gates.plan("top-k", {"cross": 6}, note=False)
    assert plan["model.decoder.layers"] == [0, 2]
    for layer in (0, 2):
        assert plan[f"model.decoder.layers.{layer}.encoder_attn"] == [0, 1, 2]
