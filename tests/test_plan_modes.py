"""The deterministic masks a gated model is evaluated with ("binary", "expected_size") are the plans their rule
exports: the same counts, the decoder's floor included, and the same function as the cut model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import tiny_bart3
from gatedprune.methods.gated import L0
from gatedprune.reports.support import logits, tiny_inputs
from gatedprune.structures.adapters import probe
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.kinds import ALL_KINDS
from gatedprune.surgery.cut import prune_heads

ATOL = 1e-5


@pytest.fixture(scope="module")
def bart3():
    return tiny_bart3()


def _gates(model, seed: int, decoder_closed: bool):
    """Every kind gated, log_alpha from U(-3, 3); with ``decoder_closed`` every decoder layer below 0 but the three
    half open (P(open) 0.40-0.45, so their expected count rounds to 1)."""
    gates = attach_gates(model, ALL_KINDS)
    generator = torch.Generator().manual_seed(seed)
    for gate in gates.gates:
        gate.log_alpha.data = torch.rand(gate.log_alpha.shape, generator=generator) * 6 - 3
    if decoder_closed:
        for n, i in enumerate(i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"):
            gates.gates[i].log_alpha.data.fill_(-1.0 - 0.1 * n)
    return gates


def _p_open(log_alpha: torch.Tensor, beta=0.33, gamma=-0.1, zeta=1.1) -> torch.Tensor:
    """Louizos et al.'s P(gate != 0), written out here."""
    return 1 / (1 + torch.exp(-(log_alpha - beta * math.log(-gamma / zeta))))


def test_the_expected_size_keeps_the_rounded_nested_expected_count_of_each_kind_by_log_alpha(bart3):
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=3, decoder_closed=False)
    try:
        keep = gates.per_site(gates.keep_mask("expected_size"))
        for kind in set(gates.kinds):
            sites = [i for i, k in enumerate(gates.kinds) if k == kind]
            alphas = torch.cat([gates.gates[i].log_alpha.detach() for i in sites])
            # nested as the budget counts it: a gate inside a gated layer counts P(gate) x P(layer)
            layer_p = torch.cat([_p_open(gates.gates[gates.outer[i]].log_alpha.detach()).expand(gates.gates[i].num_heads)
                                 if gates.outer[i] is not None else torch.ones(gates.gates[i].num_heads) for i in sites])
            count = int(math.floor((_p_open(alphas) * layer_p).sum().item() + 0.5))
            assert gates.expected_counts()[kind] == count, kind
            kept = torch.cat([keep[i] for i in sites])
            assert int(kept.sum()) == count, kind
            if 0 < count < len(alphas):  # the kept ones are the largest log_alpha (layers nest: rank by the min)
                outer = [gates.outer[i] for i in sites for _ in range(gates.gates[i].num_heads)]
                scores = torch.stack([torch.minimum(a, gates.gates[o].log_alpha.detach()[0]) if o is not None else a
                                      for a, o in zip(alphas, outer)])
                assert scores[kept].min() >= scores[~kept].max(), kind
    finally:
        gates.remove()


@pytest.mark.parametrize("mode", ["binary", "expected_size"])
@pytest.mark.parametrize("decoder_closed", [False, True])
def test_the_gated_model_in_a_plan_mode_computes_its_plans_cut_model(bart3, mode, decoder_closed):
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=5, decoder_closed=decoder_closed)
    inputs = tiny_inputs(model)
    try:
        plan = gates.plan(mode, note=False)
        decoder = plan[probe(model).layers["decoder"]]
        if decoder_closed:  # log_alpha > 0 closes all three; each rule keeps one, the floor or the expected count
            assert len(decoder) == 1
        gates.set_mode(mode)
        gated = logits(model, inputs)
        alive = gates.alive(plan)
    finally:
        gates.remove()
    pruned = prune_heads(copy.deepcopy(bart3), plan)
    assert (logits(pruned, inputs) - gated).abs().max() < ATOL
    assert alive["decoder_layer"] == len(decoder)


def test_the_mask_follows_log_alpha_once_it_changes(bart3):
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=7, decoder_closed=False).set_mode("binary")
    try:
        first = [m.clone() for m in gates.mode_mask()]
        site = next(i for i, kind in enumerate(gates.kinds) if kind == "encoder")
        with torch.no_grad():
            gates.gates[site].log_alpha.neg_()  # an optimiser's in-place step
        assert not torch.equal(gates.mode_mask()[site], first[site])
        assert torch.equal(gates.mode_mask()[site], gates.gates[site].log_alpha.detach() > 0)
    finally:
        gates.remove()


def test_an_unknown_eval_gate_mode_is_refused_with_the_modes():
    with pytest.raises(ValueError, match=r"pruning.eval_gate_mode='expected'; allowed: sample, deterministic, "
                                         r"binary, open, expected_size"):
        L0(eval_gate_mode="expected")


def test_settled_gates_are_held_at_their_expected_size_plan_through_steps_and_a_reload(bart3):
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=11, decoder_closed=True)
    try:
        expected = gates.plan_mask("expected_size", note=False)
        kept = gates.settle_(["encoder_layer", "decoder_layer"], note=False)
        layers = [i for i, kind in enumerate(gates.kinds) if kind.endswith("_layer")]
        for i in layers:
            assert gates.gates[i].log_alpha.item() == (10.0 if expected[i].item() else -10.0)
        assert len(kept["decoder"]) == 1  # three half-open decoder layers: an expected count of 1
        # an optimiser step moves every gate; clamp_ (after each step) puts the settled ones back
        optimiser = torch.optim.Adam(gates.parameters(), lr=0.5)
        gates.penalty("params").backward()
        optimiser.step()
        other = next(i for i, kind in enumerate(gates.kinds) if kind == "encoder")
        before = gates.gates[other].log_alpha.detach().clone()
        gates.clamp_()
        assert all(abs(gates.gates[i].log_alpha.item()) == 10.0 for i in layers)
        assert torch.equal(gates.gates[other].log_alpha.detach(), before)  # the others train on
        state = gates.state_dict()
        # a budget that fits everything still leaves the layers settled closed out (and keeps every other gate)
        everything = gates.per_site(gates.keep_mask("params", gates.costs["params"].prunable))
        for i in range(len(gates.gates)):
            layer = gates.outer[i] if gates.outer[i] is not None else i  # a structure goes with its layer
            closed = gates.paths[layer] in gates.settled and gates.settled[gates.paths[layer]][0] < 0
            assert bool(everything[i].all()) != closed, gates.paths[i]
    finally:
        gates.remove()
    again = attach_gates(copy.deepcopy(bart3), ALL_KINDS)
    try:
        again.load_state_dict(state)  # a resumed run holds them too
        assert again.settled == {again.paths[i]: [gates.gates[i].log_alpha.item()] for i in layers}
    finally:
        again.remove()


@pytest.mark.parametrize("value, kinds, message", [
    (0, ALL_KINDS, r"pruning.settle_layers_at=0; allowed: null or an integer >= 1 \(a gated step\)"),
    (5, ("encoder", "decoder", "cross"), r"pruning.settle_layers_at=5 settles the layer gates, and pruning.kinds="
                                          r"\['encoder', 'decoder', 'cross'\] has none"),
])
def test_settling_is_refused_where_there_is_nothing_to_settle(value, kinds, message):
    with pytest.raises(ValueError, match=message):
        L0(settle_layers_at=value, kinds=list(kinds))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_settled_depth_keeps_that_many_layers_the_most_open_ones(bart3, depth):
    """pruning.settle_depth: the decoder keeps exactly ``depth`` layers (its expected count rounds to 1 here), the
    ones with the largest log_alpha; the encoder still keeps its own expected count."""
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=11, decoder_closed=True)
    try:
        sites = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
        by_alpha = sorted(sites, key=lambda i: -gates.gates[i].log_alpha.item())  # -1.0, -1.1, -1.2: layer order
        expected = gates.plan_mask("expected_size", note=False)
        encoder = [i for i, kind in enumerate(gates.kinds) if kind == "encoder_layer"]
        kept = settle_layers_now(gates, depth)
        assert kept["decoder"] == sorted(gates.layers[i] for i in by_alpha[:depth])
        assert [gates.gates[i].log_alpha.item() > 0 for i in sites] == [i in by_alpha[:depth] for i in sites]
        assert [gates.gates[i].log_alpha.item() > 0 for i in encoder] == [bool(expected[i].item()) for i in encoder]
    finally:
        gates.remove()


@pytest.mark.parametrize("depth", [1, 2])
def test_the_bottom_rule_keeps_the_first_layers_of_each_stack_however_open_the_others_are(bart3, depth):
    """pruning.settle_keep=bottom: the decoder keeps its first ``depth`` layers although its top layers are the most
    open; the encoder (no depth given) keeps as many layers as its expected count, its first ones."""
    model = copy.deepcopy(bart3)
    gates = _gates(model, seed=11, decoder_closed=True)
    try:
        decoder = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
        for n, i in enumerate(decoder):  # the top layer the most open: the open rule would keep it first
            gates.gates[i].log_alpha.data.fill_(-1.2 + 0.1 * n)
        encoder = [i for i, kind in enumerate(gates.kinds) if kind == "encoder_layer"]
        for i, value in zip(encoder, (-2.0, -1.0, 2.0)):  # the top layer the most open here too
            gates.gates[i].log_alpha.data.fill_(value)
        count = round(sum(_p_open(gates.gates[i].log_alpha).item() for i in encoder))
        assert 0 < count < len(encoder)  # a choice to make: the open rule would keep the top layers
        kept = settle_layers_now(gates, depth, keep="bottom")
        assert kept == {"decoder": list(range(depth)), "encoder": list(range(count))}
        assert sorted(gates.settled) == sorted(gates.paths[i] for i in decoder + encoder)
    finally:
        gates.remove()


def settle_layers_now(gates, depth, keep="open"):
    from gatedprune.methods.settling import settle_layers

    settle_layers(gates, 5, {"decoder": depth}, gated_step=4, keep=keep)  # not yet
    assert not gates.settled
    settle_layers(gates, 5, {"decoder": depth}, gated_step=5, keep=keep)
    return {stack: [gates.layers[i] for i, k in enumerate(gates.kinds) if k == f"{stack}_layer"
                    and gates.gates[i].log_alpha.item() > 0] for stack in ("encoder", "decoder")}


@pytest.mark.parametrize("depth, settle_at, kinds, message", [
    ({"decoder": 2}, None, ALL_KINDS, r"pruning.settle_depth=\{'decoder': 2\} is the depth kept when the layer gates "
                                      r"settle, and pruning.settle_layers_at is null"),
    ({"decoder": 0}, 5, ALL_KINDS, r"pruning.settle_depth.decoder=0; allowed: an integer >= 1 \(layers kept\)"),
    ({"decoder": 1.5}, 5, ALL_KINDS, r"pruning.settle_depth.decoder=1.5; allowed: an integer >= 1"),
    ({"encoder": 1}, 5, [k for k in ALL_KINDS if k != "encoder_layer"],
     r"pruning.settle_depth has 'encoder'; allowed: a stack whose layers are gated \(decoder\)"),
    ({"middle": 1}, 5, ALL_KINDS, r"pruning.settle_depth has 'middle'; allowed: a stack whose layers are gated "
                                  r"\(encoder, decoder\)"),
    (2, 5, ALL_KINDS, r"pruning.settle_depth=2; allowed: null or \{stack: layers\}"),
])
def test_a_settled_depth_the_run_cannot_use_is_refused_in_one_line(depth, settle_at, kinds, message):
    with pytest.raises(ValueError, match=message):
        L0(settle_layers_at=settle_at, settle_depth=depth, kinds=list(kinds))


@pytest.mark.parametrize("keep, settle_at, message", [
    ("top", 5, r"pruning.settle_keep='top'; allowed: open, bottom"),
    ("bottom", None, r"pruning.settle_keep=bottom says which layers are kept when the layer gates settle, and "
                     r"pruning.settle_layers_at is null; allowed: with settle_layers_at, or settle_keep open"),
])
def test_a_settling_rule_the_run_cannot_use_is_refused_in_one_line(keep, settle_at, message):
    with pytest.raises(ValueError, match=message):
        L0(settle_layers_at=settle_at, settle_keep=keep, kinds=list(ALL_KINDS))


def test_a_settled_depth_deeper_than_the_model_is_refused_with_its_layers(bart3):
    method = L0(settle_layers_at=5, settle_depth={"decoder": 4}, kinds=list(ALL_KINDS))
    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ALL_KINDS)
    try:
        with pytest.raises(ValueError, match=r"pruning.settle_depth.decoder=4; allowed: an integer in \[1, 3\] "
                                             r"\(the model's decoder layers\)"):
            method.build(gates, model)
    finally:
        gates.remove()


def test_settling_after_the_gated_phase_is_refused_with_the_steps_it_has():
    method = L0(settle_layers_at=20, kinds=list(ALL_KINDS), start_step=10)
    with pytest.raises(ValueError, match=r"pruning.settle_layers_at=20 is not inside the gated phase \(20 steps: "
                                         r"trainer.max_steps=30 - pruning.start_step=10\); allowed: an integer in "
                                         r"\[1, 19\], or null, or a longer gated phase \(gated_steps\)$"):
        method.check_schedule(30)
    method.check_schedule(5)  # a dense run (start_step past max_steps) gates nothing: nothing to settle, no refusal


def test_a_run_settles_its_layer_gates_and_exports_around_them(tmp_path):
    from helpers import FAKE_TIMER, run_train
    from gatedprune.training.checkpoints import load_gated_checkpoint

    run = tmp_path / "run"
    kinds = f"pruning.kinds=[{','.join(ALL_KINDS)}]"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", kinds, "pruning.target_warmup_steps=5",
                     "pruning.settle_layers_at=8", "pruning.eval_gate_mode=expected_size",
                     "pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4",
                     "pruning.workload.repeats=1", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gated step 8: note: the gates of encoder_layer, decoder_layer are settled and held") == 1
    _, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
    layers = {gates.paths[i]: gates.gates[i].log_alpha.item() for i, k in enumerate(gates.kinds) if k.endswith("_layer")}
    assert set(layers) == set(gates.settled) and all(abs(v) == 10.0 for v in layers.values())
    opened = {path for path, value in layers.items() if value > 0}
    export = (run / "pruned" / "config.json").read_text()
    import json

    kept = json.loads(export)["gatedprune"]["kept_layers"]
    assert {f"{probe_path}.{i}" for probe_path, stack in (("model.encoder.layers", "encoder"),
                                                          ("model.decoder.layers", "decoder"))
            for i in kept[stack]} >= opened


def test_a_run_with_a_settled_depth_ships_that_many_decoder_layers(tmp_path):
    """pruning.settle_depth={decoder: 1} on the smoke model (2 decoder layers, both still open at gated step 8):
    the decoder settles to the one most open layer, and the export keeps that layer alone."""
    import json

    from helpers import FAKE_TIMER, SMOKE_LATENCY, run_train
    from gatedprune.training.checkpoints import load_gated_checkpoint

    run = tmp_path / "run"
    proc = run_train(run, *SMOKE_LATENCY, "pruning.target_warmup_steps=5", "pruning.settle_layers_at=8",
                     "pruning.settle_depth={decoder:1}", "pruning.eval_gate_mode=expected_size", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
    decoder = {gates.layers[i]: gates.gates[i].log_alpha.item() for i, k in enumerate(gates.kinds) if k == "decoder_layer"}
    assert sorted(decoder.values()) == [-10.0, 10.0], decoder
    kept = [layer for layer, value in decoder.items() if value > 0]
    assert f"decoder {kept}" in proc.stdout
    assert json.loads((run / "pruned" / "config.json").read_text())["gatedprune"]["kept_layers"]["decoder"] == kept


@pytest.mark.parametrize("keep, kept", [("open", [1]), ("bottom", [0])])
def test_a_run_settles_its_decoder_to_the_layer_its_rule_keeps(tmp_path, keep, kept):
    """settle_depth={decoder: 1} at gated step 8 of the smoke model, where its decoder's top layer is the more open
    (seed 3): the open rule keeps layer 1, the bottom rule (the recovery grid's gates_bottom1) layer 0; the layer is
    held at log_alpha +-10 and the export keeps it."""
    import json

    from helpers import FAKE_TIMER, run_train
    from gatedprune.training.checkpoints import load_gated_checkpoint

    run = tmp_path / "run"
    kinds = [k for k in ALL_KINDS if k != "encoder_layer"]
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", f"pruning.kinds=[{','.join(kinds)}]",
                     "pruning.target_warmup_steps=5", "pruning.settle_layers_at=8", "pruning.settle_depth={decoder:1}",
                     f"pruning.settle_keep={keep}", "pruning.eval_gate_mode=expected_size", "seed=3",
                     "pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4",
                     "pruning.workload.repeats=1", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gated step 8: note: the gates of decoder_layer are settled and held: kept layers "
                             f"decoder {kept}") == 1
    _, gates = load_gated_checkpoint(run / "checkpoints" / "last.ckpt")
    decoder = [gates.gates[i].log_alpha.item() for i, k in enumerate(gates.kinds) if k == "decoder_layer"]
    assert decoder == [10.0 if layer in kept else -10.0 for layer in range(2)]
    assert json.loads((run / "pruned" / "config.json").read_text())["gatedprune"]["kept_layers"]["decoder"] == kept


def test_a_run_whose_settled_depth_alone_is_over_its_target_is_refused_at_set_up(tmp_path):
    """The smoke model priced by the fake timer: two decoder layers alone, every other gated structure removed, keep
    (base + the encoder's 2 ungated layers + 2 decoder layers) / dense of its latency (0.5), above the floor with one
    decoder layer (0.4375); a target between them is refused before anything trains."""
    from helpers import FAKE_BASE, FAKE_COSTS, FAKE_TIMER, error_line, run_train

    # the smoke model: 2 + 2 layers of 4 heads and 64 FFN units
    dense = FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in {
        "encoder": 8, "decoder": 8, "cross": 8, "encoder_ffn": 128, "decoder_ffn": 128, "encoder_layer": 2,
        "decoder_layer": 2}.items())
    two = (FAKE_BASE + 2 * FAKE_COSTS["encoder_layer"] + 2 * FAKE_COSTS["decoder_layer"]) / dense
    kinds = [k for k in ALL_KINDS if k != "encoder_layer"]
    run = tmp_path / "run"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.47", f"pruning.kinds=[{','.join(kinds)}]",
                     "pruning.settle_layers_at=1", "pruning.settle_depth={decoder:2}",
                     "pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4",
                     "pruning.workload.repeats=1", prefix=FAKE_TIMER)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("error: pruning.settle_depth={'decoder': 2} keeps at least "), line
    shown = float(line.split("at least ")[1].split(" ")[0])
    assert two <= shown < two + 1e-3, (shown, two)
    assert "allowed: {'decoder': 1} (the deepest that fits), or a target of at least" in line, line
    assert not run.exists()


def test_without_the_fill_the_export_is_the_gated_model_in_eval_mode(bart3, tmp_path):
    """pruning.export_fill=false where the eval-mode mask fits: the budget's export rule is that mask, and the model
    exported by it computes what the gated model computes in that mode (not cut to the target)."""
    from gatedprune.costs.linear import LinearCost, StructureCosts
    from gatedprune.methods.budget import CostBudget
    from gatedprune.shipping.export import export_gated
    from gatedprune.surgery.model_loading import load_pruned
    from helpers import FAKE_BASE, FAKE_COSTS

    model = copy.deepcopy(bart3).eval()
    gates = _gates(model, seed=5, decoder_closed=False)
    try:
        gates.set_costs("latency", StructureCosts.of_linear(LinearCost("latency", FAKE_BASE, FAKE_COSTS), model, gates))
        mask = CostBudget(gates, "latency", 0.99, warmup_steps=0).report()["latency"]["expected_size_kept"]
        budget = CostBudget(gates, "latency", min(0.99, mask + 0.05), warmup_steps=0, ships="expected_size")
        rule, top_k = budget.export_rule()
        assert (rule, top_k) == ("expected_size", None)
        assert gates.dropped(gates.plan(rule, note=False))  # a layer goes, with what its gates kept inside it
        export_gated(model, gates, tmp_path / "out", rule=rule, top_k=top_k)
        inputs = tiny_inputs(model)
        gates.set_mode("expected_size")
        with torch.no_grad():
            gated, shipped = logits(model, inputs), logits(load_pruned(tmp_path / "out").eval(), inputs)
        torch.testing.assert_close(shipped, gated, atol=ATOL, rtol=0)
    finally:
        gates.remove()


def test_without_the_fill_a_run_whose_mask_is_over_the_target_fills_to_it(tmp_path):
    """pruning.export_fill=false where the eval-mode mask is over the target (30 smoke steps do not reach 0.6): the
    export keeps the most open structures that fit, and the run says which rule it took."""
    import json

    from helpers import FAKE_TIMER, run_train

    run = tmp_path / "run"
    kinds = f"pruning.kinds=[{','.join(ALL_KINDS)}]"
    proc = run_train(run, "pruning=l0_budget", "pruning.target_latency=0.6", kinds, "pruning.target_warmup_steps=5",
                     "pruning.settle_layers_at=8", "pruning.eval_gate_mode=expected_size", "pruning.export_fill=false",
                     "pruning.workload.source_tokens=6", "pruning.workload.target_tokens=4",
                     "pruning.workload.repeats=1", prefix=FAKE_TIMER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    budget = metrics["budget"]["latency"]
    report = json.loads((run / "pruned" / "export_report.json").read_text())
    assert metrics["gated"]["gate_mode"] == "expected_size" and budget["expected_size_kept"] > 0.6, budget
    assert budget["plan_rule"] == "latency" and budget["plan_kept"] <= 0.6
    assert report["predicted"]["latency"] == pytest.approx(budget["plan_kept"])
    assert "the export keeps the most open structures that fit the target" in proc.stdout


def test_plans_differ_by_the_layers_and_the_structures_inside_layers_both_keep(bart3):
    """export_report's decided_by_rule: a layer one plan drops counts once, not with every head and unit in it."""
    model = copy.deepcopy(bart3)
    gates = attach_gates(model, ALL_KINDS)
    try:
        full = gates.plan(note=False)  # every gate starts open
        layers = gates.layers_paths["decoder_layer"]
        sites = [(path, layer) for path, kind, layer in zip(gates.paths, gates.kinds, gates.layers) if kind == "decoder"]
        (first, first_layer), (last, last_layer) = sites[0], sites[-1]
        one = {**full, layers: [l for l in full[layers] if l != last_layer]}  # the last decoder layer dropped
        other = {**full, first: full[first][1:], last: full[last][2:]}  # one head of the first, two of the last gone
        assert first_layer != last_layer and len(full[layers]) == 3
        # the dropped layer (1) and the first layer's head (1); the two heads inside the dropped layer are not counted
        assert gates.differences(one, other) == gates.differences(other, one) == 2
        assert gates.differences(one, one) == 0 and gates.differences(full, other) == 3
    finally:
        gates.remove()
