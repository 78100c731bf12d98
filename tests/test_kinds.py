"""Feed-forward units and whole layers as prunable kinds, on every family: a closed gate against a reference built
here by other means, surgery against masking, parameter counts, both reload paths, the edge plans, and the
nesting-aware cost against its formula."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from gatedprune import load_pruned
from gatedprune.reports.support import build_tiny, greedy, logits, tiny_config, tiny_inputs
from gatedprune.shipping.export_dir import save_pruned
from gatedprune.structures.adapters import probe
from gatedprune.structures.ffn import ffn_sites
from gatedprune.structures.head_gates import attach_gates, non_embedding_parameters
from gatedprune.structures.kinds import ALL_KINDS, FFN_KINDS, LAYER_KINDS
from gatedprune.structures.masking import masked_heads
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import check_plan, count_parameters, prune_heads, removed_parameters

ATOL = 1e-5
# one family per layout for the checks of cached greedy generation (bart-like, t5-like, llama-like)
CACHED = ("bart", "t5", "t5gemma")


def _stack(model, stack: str):
    return model.get_submodule(probe(model).layers[stack])


def _ffn_input(model, stack: str, layer: int) -> torch.nn.Linear:
    """The input projection whose rows, zeroed, switch a unit off whatever the activation (act(0) = 0, or the linear
    half of a gated block): found here by name, not through gatedprune's layout table."""
    block = _stack(model, stack)[layer]
    names = [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)
             and n.rpartition(".")[2] in ("fc1", "wi", "wi_1", "up_proj")]
    (name,) = names
    return block.get_submodule(name)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_closed_unit_gate_is_the_unit_switched_off(model_of, family, stack):
    model = model_of(family)
    inputs = tiny_inputs(model)
    reference = logits(model, inputs)
    gates = attach_gates(model, [f"{stack}_ffn"], init_log_alpha=5.0).set_mode("deterministic")
    assert torch.equal(logits(model, inputs), reference)  # open gates change nothing
    last = len(gates.gates) - 1
    with torch.no_grad():
        gates.gates[last].log_alpha[[1, 3]] = -5.0  # deterministic gate exactly 0
    gated = logits(model, inputs)
    gates.remove()
    zeroed = copy.deepcopy(model)
    projection = _ffn_input(zeroed, stack, layer=gates.layers[last])
    with torch.no_grad():
        projection.weight[[1, 3]] = 0
        if projection.bias is not None:
            projection.bias[[1, 3]] = 0
    expected = logits(zeroed, inputs)
    error, effect = (gated - expected).abs().max(), (reference - expected).abs().max()
    assert error < 1e-6 and effect > 100 * error, (error, effect)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_closed_layer_gate_is_the_layer_left_out(model_of, family, stack):
    model = model_of(family)
    inputs = tiny_inputs(model)
    reference = logits(model, inputs)
    gates = attach_gates(model, [f"{stack}_layer"], init_log_alpha=5.0).set_mode("deterministic")
    assert torch.equal(logits(model, inputs), reference)
    with torch.no_grad():
        gates.gates[-1].log_alpha.fill_(-5.0)  # the last layer of the stack
    gated = logits(model, inputs)
    gates.remove()
    shorter = copy.deepcopy(model)
    layers = _stack(shorter, stack)
    del layers[len(layers) - 1]  # the last layer: nothing after it reads its index
    expected = logits(shorter, {**inputs, "use_cache": False})
    error, effect = (gated - expected).abs().max(), (reference - expected).abs().max()
    assert error < 1e-6 and effect > 100 * error, (error, effect)


def _mixed_plan(model, drop: dict[str, list[int]]) -> dict:
    """Every kind at once: some heads and units of each site, and the layers of ``drop`` removed."""
    plan = {site.path: [i for i in range(site.num_units) if (i + site.layer) % 3]
            for site in structure_sites(model, [k for k in ALL_KINDS if k not in LAYER_KINDS])}
    for stack, path in probe(model).layers.items():
        plan[path] = [i for i in range(len(model.get_submodule(path))) if i not in drop.get(stack, [])]
    return plan


def _check_surgery(model, plan, directory, cached: bool) -> None:
    inputs = tiny_inputs(model)
    with masked_heads(model, plan):
        expected = logits(model, inputs)
        expected_tokens = greedy(model, inputs) if cached else None
    before, removed = count_parameters(model), removed_parameters(model, plan)
    prune_heads(model, plan)
    assert (logits(model, inputs) - expected).abs().max() < ATOL
    if cached:
        assert torch.equal(greedy(model, inputs), expected_tokens)  # with the cache: layer_idx renumbered
    assert count_parameters(model) == before - removed
    save_pruned(model, directory)
    for again in (load_pruned(directory),
                  transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, trust_remote_code=True)):
        again.eval()
        assert torch.equal(logits(again, inputs), logits(model, inputs))
        assert count_parameters(again) == count_parameters(model)
        if cached:
            assert torch.equal(greedy(again, inputs), expected_tokens)


@pytest.mark.parametrize("drop", [{}, {"encoder": [0], "decoder": [1]}], ids=["layers kept", "first enc, last dec"])
def test_surgery_of_every_kind_equals_masking(model_of, family, drop, tmp_path):
    _check_surgery(model_of(family), _mixed_plan(model_of(family), drop), tmp_path / "out", family in CACHED)


@pytest.mark.parametrize("family", CACHED)
@pytest.mark.parametrize("edge", ["every unit of a layer", "all decoder layers but one", "every encoder layer",
                                  "an encoder shallower than its decoder"])
def test_edge_plans_run_and_generate(model_of, family, edge, tmp_path):
    model = model_of(family)
    layers = probe(model).layers
    plan = {
        "every unit of a layer": {s.path: [] for s in structure_sites(model, FFN_KINDS) if s.layer == 0},
        "all decoder layers but one": {layers["decoder"]: [1]},
        "every encoder layer": {layers["encoder"]: []},
        # T5's decoder view of its config counted the encoder's layers: the generation cache was one layer short
        "an encoder shallower than its decoder": {layers["encoder"]: [1]},
    }[edge]
    _check_surgery(model, plan, tmp_path / "out", cached=True)
    assert greedy(model, tiny_inputs(model)).shape[1] > 1


def test_pruning_twice_composes_and_counts_what_went(model_of, tmp_path):
    model = model_of("t5")
    once = copy.deepcopy(model)
    layers = probe(model).layers
    prune_heads(model, _mixed_plan(model, {}))
    prune_heads(model, {layers["encoder"]: [1], layers["decoder"]: [0]})  # the first encoder layer goes second
    record = model.config.gatedprune
    assert record["kept_layers"] == {"encoder": [1], "decoder": [0]} and record["format"] == 3
    assert count_parameters(model) == count_parameters(once) - sum(
        e["parameters"] for entries in record["dropped"].values() for e in entries) - sum(
        removed_parameters(once, {p: k}) for p, k in _mixed_plan(once, {}).items()
        if p.startswith((f"{layers['encoder']}.1.", f"{layers['decoder']}.0.")))
    save_pruned(model, tmp_path / "out")
    assert count_parameters(load_pruned(tmp_path / "out")) == count_parameters(model)


def test_a_plan_that_drops_every_decoder_layer_is_refused(model_of):
    model = model_of("bart")
    with pytest.raises(ValueError, match="a decoder keeps at least one layer"):
        check_plan(model, {"model.decoder.layers": []})
    with pytest.raises(ValueError, match=r"layer 2 does not exist \(the module has layers 0..1\)"):
        check_plan(model, {"model.encoder.layers": [2]})


def test_gates_closing_every_decoder_layer_keep_the_most_open(model_of, capsys):
    model = model_of("marian")
    gates = attach_gates(model, ["decoder_layer"])
    with torch.no_grad():
        gates.gates[0].log_alpha.fill_(-3.0)
        gates.gates[1].log_alpha.fill_(-1.0)
    assert gates.plan() == {"model.decoder.layers": [1]}
    assert "keeps the most open one, layer 1" in capsys.readouterr().out


def test_ffn_group_gates_contiguous_units(tmp_path):
    model = build_tiny(transformers.BartForConditionalGeneration)  # FFN 48 wide
    gates = attach_gates(model, ["encoder_ffn"], ffn_group=8)
    assert [g.num_heads for g in gates.gates] == [6, 6]
    with torch.no_grad():
        gates.gates[0].log_alpha[[0, 5]] = -3.0
    plan = gates.plan()
    assert plan["model.encoder.layers.0.fc2"] == list(range(8, 40)) and len(plan["model.encoder.layers.1.fc2"]) == 48
    with pytest.raises(ValueError, match="pruning.ffn_group=5: model.encoder.layers.0.fc2 has 48 units"):
        attach_gates(model, ["encoder_ffn"], ffn_group=5)


@pytest.mark.parametrize("cls", ["NllbMoeForConditionalGeneration", "SwitchTransformersForConditionalGeneration"])
def test_mixture_of_experts_refuses_the_unit_kinds(cls):
    cls = getattr(transformers, cls)
    config = tiny_config(cls.config_class())
    for field in ("encoder_sparse_step", "decoder_sparse_step"):  # every layer sparse (2 layers: none by default)
        if hasattr(config, field):
            setattr(config, field, 1)
    config.num_experts = 4
    model = cls(config).eval()
    with pytest.raises(ValueError, match="mixture of experts") as refused:
        attach_gates(model, ["decoder_ffn"])
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="placed by layer index"):
        attach_gates(model, ["decoder_layer"])  # which layers are sparse follows their index
    attach_gates(model, ["decoder", "cross"])  # heads still gate


def _formula(model, gates) -> tuple[float, float]:
    """The expected kept prunable parameters and the prunable ones, from the parameter shapes, written out here:
    E = sum over layers L of P(L) * (params(L) - gated parts + sum_g P(g) * params(g))."""
    expected, prunable = 0.0, 0
    for stack in ("encoder", "decoder"):
        for index, layer in enumerate(_stack(model, stack)):
            size = sum(p.numel() for p in layer.parameters())
            p_layer = next((g.p_open().item() for g, k, i in zip(gates.gates, gates.kinds, gates.layers)
                            if k == f"{stack}_layer" and i == index), None)
            inner, gated = 0.0, 0
            for gate, kind, i, path in zip(gates.gates, gates.kinds, gates.layers, gates.paths):
                if i != index or not kind.startswith(stack if stack == "encoder" else ("decoder", "cross")):
                    continue
                if kind.endswith("_layer"):
                    continue
                module = model.get_submodule(path)
                if kind.endswith("_ffn"):
                    container = model.get_submodule(path.rpartition(".")[0])
                    one = sum(m.in_features + (m.bias is not None) for n, m in container.named_children()
                              if n in ("fc1",)) + module.out_features
                else:
                    d = module.head_dim
                    one = sum(d * (m.in_features + (m.bias is not None)) for m in (module.q_proj, module.k_proj,
                                                                                  module.v_proj)) + d * module.out_proj.out_features
                inner += (gate.p_open() * one).sum().item()
                gated += one * gate.num_heads
            if p_layer is None:
                expected, prunable = expected + inner, prunable + gated
            else:
                expected, prunable = expected + p_layer * (size - gated + inner), prunable + size
    return expected, prunable


@pytest.mark.parametrize("kinds", [["encoder", "decoder_ffn"], ["cross", "encoder_ffn", "decoder_layer"], ALL_KINDS],
                         ids=["no layers", "one stack's layers", "everything"])
def test_expected_kept_parameters_follow_their_formula(model_of, kinds):
    model = model_of("bart")
    gates = attach_gates(model, kinds)
    torch.manual_seed(0)
    with torch.no_grad():
        for gate in gates.gates:
            gate.log_alpha.uniform_(-3, 3)
    expected, prunable = _formula(model, gates)
    assert gates.prunable_params == prunable
    assert gates.expected_params().item() == pytest.approx(expected, rel=1e-5)
    assert gates.penalty("params").item() == pytest.approx(expected / prunable, rel=1e-5)
    gates.penalty("params").backward()  # differentiable in every gate
    assert all(g.log_alpha.grad is not None and g.log_alpha.grad.abs().sum() > 0 for g in gates.gates)


def test_a_closed_layer_takes_its_heads_and_units_out_of_the_cost(model_of):
    model = model_of("bart")
    gates = attach_gates(model, ALL_KINDS, init_log_alpha=10.0)
    open_all = gates.expected_params().item()
    assert open_all == pytest.approx(gates.prunable_params, rel=1e-3)
    layer = next(i for i, k in enumerate(gates.kinds) if k == "encoder_layer")
    with torch.no_grad():
        gates.gates[layer].log_alpha.fill_(-10.0)
    size = sum(p.numel() for p in _stack(model, "encoder")[gates.layers[layer]].parameters())
    assert open_all - gates.expected_params().item() == pytest.approx(size, rel=1e-3)
    # the other encoder layer's 4 heads still count, those of the closed one no longer
    assert gates.expected_open_per_kind()["encoder"] == pytest.approx(4, rel=1e-3)


def test_the_params_rule_keeps_the_most_open_structures_that_fit(model_of):
    model = model_of("bart")
    gates = attach_gates(model, ALL_KINDS)
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in gates.gates:
            gate.log_alpha.uniform_(-3, 3)
    allowed = gates.prunable_params // 2
    plan = gates.plan("params", allowed)
    gates.remove()
    kept = gates.prunable_params - removed_parameters(model, plan)
    assert kept <= allowed and kept > 0.8 * allowed


def test_non_embedding_parameters_leave_out_the_embeddings_only(model_of):
    model = model_of("bart")
    embeddings = {id(p): p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    assert non_embedding_parameters(model) == count_parameters(model) - sum(embeddings.values())
    t5 = model_of("t5")  # its relative position bias sits in a layer: counted, not an embedding
    tokens = {id(p): p.numel() for p in (t5.shared.weight, t5.lm_head.weight)}
    assert non_embedding_parameters(t5) == count_parameters(t5) - sum(tokens.values())


def test_ffn_sites_name_their_blocks_by_output_projection(model_of):
    t5 = model_of("mt5")  # a gated block: wi_0 and wi_1
    (site, *_), = [ffn_sites(t5, "decoder", "decoder.block", "decoder_ffn")]
    assert site.path == "decoder.block.0.layer.2.DenseReluDense.wo" and site.layout.inputs == ("wi_0", "wi_1")


def test_every_kind_exports_verified_on_every_family(model_of, family, tmp_path):
    from gatedprune.shipping.export import export_gated

    model = model_of(family)
    gates = attach_gates(model, ALL_KINDS)
    torch.manual_seed(2)
    with torch.no_grad():
        for gate in gates.gates:
            gate.log_alpha.uniform_(-2, 6)  # most open: some heads, units and a layer or two closed
    report = export_gated(model, gates, tmp_path / "out")
    check = report["verification"]
    assert check["passed"] and check["greedy_identical"] and check["params_match"]
    removed = sum(total - kept for kept, total in [*report["units_kept"].values(), *report["layers_kept"].values()])
    assert removed > 0 and report["params_after"] < report["params_before"]


def test_dropping_a_layer_keeps_per_layer_lists_and_indices_in_step(model_of):
    model = model_of("t5gemma")  # reads config.layer_types[i]: sliding window in layer 0, full attention in layer 1
    assert model.config.decoder.layer_types == ["sliding_attention", "full_attention"]
    prune_heads(model, {probe(model).layers["decoder"]: [1]})
    assert model.config.decoder.layer_types == ["full_attention"] and model.config.decoder.num_hidden_layers == 1
    assert [layer.self_attn.layer_idx for layer in model.model.decoder.layers] == [0]
