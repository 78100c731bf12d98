"""Gates on real model families: identity when open, head removal when closed, gradients, generation."""

import pytest
import torch
import transformers

from families import ATTN_IMPLEMENTATIONS, FAMILIES, tiny_model
from gatedprune import attach_gates
from gatedprune.structures.adapters import ATTENTION_KINDS, attention_sites


def _inputs(model):
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab - 2, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -2:] = 0  # one padded sentence
    labels = torch.randint(3, vocab - 2, (2, 5))
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _set_log_alpha(gates, site, values):
    with torch.no_grad():
        gates.gates[site].log_alpha.copy_(torch.tensor(values, dtype=torch.float))


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return request.param, tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_open_gates_leave_logits_unchanged(family_model):
    _, model = family_model
    batch = _inputs(model)
    with torch.no_grad():
        reference = model(**batch).logits
        gates = attach_gates(model, init_log_alpha=5.0)  # deterministic gate exactly 1
        gated = model(**batch).logits
        gates.set_mode("binary")
        binary = model(**batch).logits
        gates.remove()
        detached = model(**batch).logits
    assert torch.equal(reference, gated) and torch.equal(reference, binary) and torch.equal(reference, detached)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize(
    ("family", "attn_implementation"), [(f, impl) for f in FAMILIES for impl in ATTN_IMPLEMENTATIONS[f]]
)
def test_closed_gate_equals_zeroed_value_rows(family, kind, attn_implementation, tmp_path):
    """Closing the gates of every query head that reads key/value head 1 (one head, without grouping) equals
    zeroing that key/value head's value rows."""
    model = tiny_model(family, tmp_path, attn_implementation=attn_implementation)
    batch = _inputs(model)
    site_index = next(i for i, s in enumerate(attention_sites(model)) if s.kind == kind and s.layer == 1)
    kv_head = 1

    reference = tiny_model(family, tmp_path / "ref", attn_implementation=attn_implementation)
    site = attention_sites(reference)[site_index]
    group = site.num_heads // site.num_kv_heads  # query heads per key/value head
    rows = slice(kv_head * site.head_dim, (kv_head + 1) * site.head_dim)
    with torch.no_grad():
        site.projection("v").weight[rows] = 0
        if site.projection("v").bias is not None:
            site.projection("v").bias[rows] = 0
        expected = reference(**batch).logits

        gates = attach_gates(model, init_log_alpha=5.0).set_mode("deterministic")
        values = [5.0] * gates.gates[site_index].num_heads
        closed = range(kv_head * group, (kv_head + 1) * group)
        for head in closed:
            values[head] = -5.0  # deterministic gate exactly 0
        _set_log_alpha(gates, site_index, values)
        gated = model(**batch).logits
        unchanged = tiny_model(family, tmp_path / "plain", attn_implementation=attn_implementation)(**batch).logits
    error = (gated - expected).abs().max()
    effect = (unchanged - expected).abs().max()  # what removing the head changes
    assert error < 1e-6 and effect > 100 * error
    assert gates.plan()[gates.paths[site_index]] == [h for h in range(len(values)) if h not in closed]


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_gradients_reach_gates_of_every_kind(family_model, kind):
    _, model = family_model
    gates = attach_gates(model, kinds=(kind,), init_log_alpha=0.5)
    try:
        model.train()
        torch.manual_seed(0)
        loss = model(**_inputs(model)).logits.square().mean()
        loss.backward()
        assert all(s == kind for s in gates.kinds)
        for gate in gates.gates:
            assert gate.log_alpha.grad is not None and gate.log_alpha.grad.abs().sum() > 0
    finally:
        gates.remove()
        model.zero_grad(set_to_none=True)
        model.eval()


def test_generate_runs_with_deterministic_gates(family_model):
    _, model = family_model
    gates = attach_gates(model, init_log_alpha=1.0).set_mode("deterministic")
    try:
        batch = _inputs(model)
        out = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            max_new_tokens=6, min_new_tokens=4, num_beams=2, do_sample=False,
        )
        assert out.shape[0] == 2 and out.shape[1] >= 5
    finally:
        gates.remove()


def test_sample_mode_draws_noise_only_in_training(family_model):
    _, model = family_model
    gates = attach_gates(model, init_log_alpha=0.0)
    try:
        batch = _inputs(model)
        with torch.no_grad():
            model.eval()
            a, b = model(**batch).logits, model(**batch).logits
            model.train()
            c, d = model(**batch).logits, model(**batch).logits
        assert torch.equal(a, b) and not torch.equal(c, d)
    finally:
        model.eval()
        gates.remove()


def test_expected_open_and_penalty_normalisations(family_model):
    _, model = family_model
    gates = attach_gates(model, kinds=("encoder", "cross"), init_log_alpha=0.0)
    try:
        _set_log_alpha(gates, 0, [1.0, -1.0, 2.0, 0.0])
        p = [g.p_open().detach() for g in gates.gates]
        total = sum(x.sum() for x in p)
        assert gates.num_heads == 16 and len(gates.gates) == 4
        torch.testing.assert_close(gates.expected_open().detach(), total)
        torch.testing.assert_close(gates.penalty("sum").detach(), total)
        torch.testing.assert_close(gates.penalty("layer_mean").detach(), total / 4)
        torch.testing.assert_close(gates.penalty("head_mean").detach(), total / 16)
        # log_alpha > 0 keeps heads 0 and 2 of the first site; log_alpha 0 elsewhere keeps nothing
        assert gates.heads_alive() == {"total": 2, "encoder": 2, "cross": 0}
        per_kind = gates.expected_open_per_kind()  # sites in order: encoder layers, then cross layers
        assert gates.kinds == ["encoder", "encoder", "cross", "cross"]
        assert per_kind["encoder"] == pytest.approx(float(p[0].sum() + p[1].sum()))
        assert per_kind["cross"] == pytest.approx(float(p[2].sum() + p[3].sum()))
        assert per_kind["total"] == pytest.approx(float(total)) and list(per_kind) == ["total", "encoder", "cross"]
        with pytest.raises(ValueError, match="unknown penalty normalisation 'mean'; allowed: layer_mean, sum, head_mean"):
            gates.penalty("mean")
    finally:
        gates.remove()


def test_gates_travel_in_state_dict(family_model):
    _, model = family_model
    gates = attach_gates(model, init_log_alpha=0.7)
    other = attach_gates(model, init_log_alpha=-1.0)
    try:
        other.load_state_dict(gates.state_dict())
        assert all(torch.equal(a.log_alpha, b.log_alpha) for a, b in zip(gates.gates, other.gates))
        assert gates.state_dict()["_extra_state"]["paths"] == gates.paths
    finally:
        gates.remove()
        other.remove()


def test_unknown_kind_is_refused(family_model):
    _, model = family_model
    with pytest.raises(ValueError, match=r"unknown kind\(s\) \['self'\] in pruning.kinds; allowed: encoder, decoder, cross, encoder_ffn"):
        attach_gates(model, kinds=("encoder", "self"))


def test_unsupported_model_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="unsupported model class GPT2LMHeadModel: no decoder layers with cross-attention"):
        attach_gates(model)
