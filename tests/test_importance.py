"""Michel et al. head importance against an independent reference, on every family; zeroed and gated heads score 0."""

import pytest
import torch
import torch.nn.functional as F

from gatedprune import attach_gates
from gatedprune.structures.adapters import attention_sites
from gatedprune.methods.importance import head_importance, rank_heads


def _batches(model) -> list[dict]:
    """Two batches of different sizes, padded on the source and the target side, one target with ignored tokens
    first; the second batch brings its own decoder inputs."""
    generator = torch.Generator().manual_seed(0)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id
    batches = []
    for size, source, target, source_pads, target_pads in ((2, 7, 5, (0, 3), (2, 0)), (3, 4, 6, (1, 0, 2), (0, 4, 1))):
        input_ids = torch.randint(3, vocab - 2, (size, source), generator=generator)  # (B, S)
        labels = torch.randint(3, vocab - 2, (size, target), generator=generator)  # (B, T)
        attention_mask = torch.ones_like(input_ids)
        for row, (s, t) in enumerate(zip(source_pads, target_pads)):
            input_ids[row, source - s:], attention_mask[row, source - s:] = pad, 0
            labels[row, target - t:] = -100
        batches.append(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels))
    # target tokens left out of the loss before scored ones (a prompt, say) shape the loss through the decoder's
    # attention: only counting valid tokens excludes them (a pad at the end gets no gradient anyway)
    batches[0]["labels"][1, :2] = -100
    batches[1]["decoder_input_ids"] = torch.randint(3, vocab - 2, batches[1]["labels"].shape, generator=generator)
    return batches


def _reference(model, batches) -> dict[str, torch.Tensor]:
    """Raw importance through a mask m (B, T, H) of ones on every head at every token: |dL/dm_{t,h}| is
    |o_{h,t} . dL/do_{h,t}| for one token alone, so the absolute value is taken per token."""
    sites = attention_sites(model)
    masks, totals, counts = {}, {s.path: 0.0 for s in sites}, {"encoder": 0, "target": 0}

    def hook_of(site):
        def hook(o_proj, args):
            (x, *rest) = args  # (B, T, H*D)
            m = torch.ones(*x.shape[:2], site.num_heads, requires_grad=True)  # (B, T, H)
            masks[site.path] = m
            return ((x.unflatten(-1, (site.num_heads, -1)) * m[..., None]).flatten(-2), *rest)

        return hook

    handles = [s.projection("o").register_forward_pre_hook(hook_of(s)) for s in sites]
    try:
        for batch in batches:
            targets = {k: batch[k] for k in ("decoder_input_ids",) if k in batch} or {"labels": batch["labels"]}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **targets).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
            grads = torch.autograd.grad(loss, [masks[s.path] for s in sites])
            valid = {"encoder": batch["attention_mask"] == 1, "target": batch["labels"] != -100}  # (B, S), (B, T)
            for site, grad in zip(sites, grads):
                side = "encoder" if site.kind == "encoder" else "target"
                totals[site.path] = totals[site.path] + grad.abs()[valid[side]].sum(0)
            counts = {side: counts[side] + int(v.sum()) for side, v in valid.items()}
    finally:
        for handle in handles:
            handle.remove()
    return {s.path: totals[s.path] / counts["encoder" if s.kind == "encoder" else "target"] for s in sites}


def test_matches_per_token_mask_reference(family, model_of):
    model = model_of(family)
    batches = _batches(model)
    reference = _reference(model, batches)
    raw = head_importance(model, batches, layer_norm_exponent=None)
    normalised = head_importance(model, batches)
    assert list(raw) == [s.path for s in attention_sites(model)]
    for path, expected in reference.items():
        assert raw[path].shape == expected.shape and (expected > 0).all()
        torch.testing.assert_close(raw[path], expected)
        torch.testing.assert_close(normalised[path], expected / expected.norm())
        torch.testing.assert_close(normalised[path].norm(), torch.tensor(1.0))


def test_zeroed_value_head_scores_zero_and_ranks_first(family, model_of):
    """Zeroing key/value head 1's value rows in layer 1 of each kind silences every query head that reads it."""
    model = model_of(family)
    silenced = []
    with torch.no_grad():
        for site in attention_sites(model):
            if site.layer != 1:
                continue
            group = site.num_heads // site.num_kv_heads  # query heads per key/value head
            v = site.projection("v")
            v.weight[site.head_dim:2 * site.head_dim] = 0
            if v.bias is not None:
                v.bias[site.head_dim:2 * site.head_dim] = 0
            silenced += [(site.path, h) for h in range(group, 2 * group)]
    importance = head_importance(model, _batches(model))
    for path, head in silenced:
        assert importance[path][head] == 0
    heads = sum(len(s) for s in importance.values())
    assert sum(int((s > 0).sum()) for s in importance.values()) == heads - len(silenced)  # only those
    assert rank_heads(importance)[: len(silenced)] == silenced


def test_head_closed_by_gates_scores_zero(family, model_of):
    """Heads 0 and 2 of every other module closed, and every head of the first: the latter stays 0 when normalised."""
    model = model_of(family)
    gates = attach_gates(model)
    try:
        closed = {path: [0, 2] for path in gates.paths[2::2]} | {gates.paths[0]: list(range(gates.gates[0].num_heads))}
        gates.fix_({path: [h for h in range(4) if h not in heads] for path, heads in closed.items()}).set_mode("binary")
        importance = head_importance(model, _batches(model))
    finally:
        gates.remove()
    for path, scores in importance.items():
        assert ((scores == 0) == torch.tensor([h in closed.get(path, []) for h in range(len(scores))])).all()


def test_leaves_model_as_found(family, model_of):
    model = model_of(family).train()
    model.get_submodule(attention_sites(model)[0].path).eval()  # a mixed state is restored module by module
    modes = {name: m.training for name, m in model.named_modules()}
    params = dict(model.named_parameters())
    frozen = next(iter(params))
    params[frozen].requires_grad_(False)
    for i, (name, p) in enumerate(params.items()):
        p.grad = torch.randn_like(p) if i % 2 else None
    before = {name: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for name, p in params.items()}
    importance = head_importance(model, _batches(model), kinds=("cross",), progress=True)
    assert [s.path for s in attention_sites(model, "cross")] == list(importance)
    assert {name: m.training for name, m in model.named_modules()} == modes
    for name, p in params.items():
        weight, grad = before[name]
        assert torch.equal(p, weight) and p.requires_grad == (name != frozen)
        assert (p.grad is None and grad is None) or torch.equal(p.grad, grad)


def test_frozen_model_still_scored(model_of):
    """With no parameter requiring a gradient the heads' outputs are still differentiated."""
    model = model_of("bart").requires_grad_(False)
    batches = _batches(model)
    expected = head_importance(model_of("bart"), batches)
    for path, scores in head_importance(model, batches).items():
        torch.testing.assert_close(scores, expected[path])
    assert not any(p.requires_grad for p in model.parameters())


def test_rank_heads_is_stable_across_sites():
    importance = {"a": torch.tensor([0.5, 0.1, 0.5]), "b": torch.tensor([0.1, 0.0])}
    assert rank_heads(importance) == [("b", 1), ("a", 1), ("b", 0), ("a", 0), ("a", 2)]


def test_no_tokens_is_an_error(model_of):
    with pytest.raises(ValueError, match="at least one batch"):
        head_importance(model_of("bart"), [])
