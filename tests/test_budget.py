"""An exact head budget: targets resolve, the Lagrangian pushes towards them, top-k meets them exactly."""

import json

import pytest
import torch

from gatedprune import attach_gates
from gatedprune.methods.budget import HeadBudget, resolve_targets
from gatedprune.train import train

from helpers import compose_train


def test_targets_resolve_from_counts_fractions_and_kinds(model_of):
    gates = attach_gates(model_of("bart"))  # 2 layers x 4 heads x 3 kinds = 24 heads
    try:
        assert resolve_targets(10, gates) == {"total": 10}
        assert resolve_targets(0.25, gates) == {"total": 6}
        assert resolve_targets({"encoder": 2, "cross": 0.5}, gates) == {"encoder": 2, "cross": 4}
        with pytest.raises(ValueError, match=r"pruning.target_heads=30 for total: allowed a count from 0 to the 24"):
            resolve_targets(30, gates)
        with pytest.raises(ValueError, match=r"names 'self', which is not gated; allowed: encoder, decoder, cross"):
            resolve_targets({"self": 2}, gates)
        with pytest.raises(ValueError, match=r"target_heads=-1 for total"):
            resolve_targets(-1, gates)
    finally:
        gates.remove()


def test_lagrangian_gradients_ascend_on_multipliers_and_descend_on_gates(model_of):
    gates = attach_gates(model_of("t5"), init_log_alpha=3.0)
    try:
        budget = HeadBudget(gates, {"total": 6}, warmup_steps=10)
        torch.testing.assert_close(budget.target_fraction(0), torch.tensor([1.0]))
        torch.testing.assert_close(budget.target_fraction(5), torch.tensor([1 - 0.5 * 18 / 24]))
        torch.testing.assert_close(budget.target_fraction(50), torch.tensor([6 / 24]))
        with torch.no_grad():
            budget.lambda1.fill_(1.0)
        budget(50).backward()
        gap = (budget.expected_fraction() - 0.25).detach()
        assert gap.item() > 0  # gates open: s > t
        torch.testing.assert_close(budget.lambda1.grad, -gap)  # negated: the optimiser's step raises lambda1
        assert all((g.log_alpha.grad > 0).all() for g in gates.gates)  # descent lowers log_alpha (closes gates)
    finally:
        gates.remove()


def test_top_k_rule_keeps_exactly_k_overall_and_per_kind(model_of):
    gates = attach_gates(model_of("mbart"))
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for g in gates.gates:
                g.log_alpha.normal_()
        assert sum(len(k) for k in gates.plan("top-k", 7).values()) == 7
        plan = gates.plan("top-k", {"encoder": 3, "cross": 0})
        per_kind = {kind: 0 for kind in ("encoder", "decoder", "cross")}
        for path, kind in zip(gates.paths, gates.kinds):
            per_kind[kind] += len(plan[path])
        binary_decoder = sum(len(gates.kept(i)) for i, k in enumerate(gates.kinds) if k == "decoder")
        assert per_kind == {"encoder": 3, "decoder": binary_decoder, "cross": 0}
    finally:
        gates.remove()


@pytest.mark.parametrize("target", [5, 15])
def test_target_heads_are_met_exactly_after_training(tmp_path, target):
    cfg = compose_train(tmp_path, "experiment=smoke", "pruning=l0_budget", f"pruning.target_heads={target}", "trainer.max_steps=60",
                        "pruning.target_warmup_steps=20", "pruning.lagrangian_lr=0.2")
    metrics = train(cfg)
    assert metrics["target_heads"] == {"total": target}
    assert metrics["export"]["heads_kept"]["total"][0] == target
    exported = json.loads((tmp_path / "pruned" / "config.json").read_text())["gatedprune"]["kept_heads"]
    assert sum(len(k) for per_kind in exported.values() for k in per_kind.values()) == target
    # the controller, not only the final rule, brought the gates there
    assert abs(metrics["expected_open"] - target) < 4


def test_a_per_kind_budget_is_accepted_from_the_command_line_and_nan_refused(tmp_path):
    from hydra.utils import instantiate

    cfg = compose_train(tmp_path, "pruning=l0_budget", "pruning.target_heads={encoder:4,cross:0.5}")
    assert instantiate(cfg.pruning, _convert_="all").target_heads == {"encoder": 4, "cross": 0.5}
    bad = compose_train(tmp_path, "pruning=l0_budget", "pruning.target_heads={encoder:nan}")
    with pytest.raises(Exception, match=r"pruning.target_heads=\{'encoder': nan\} is not a finite number"):
        instantiate(bad.pruning, _convert_="all")


def test_a_fork_from_a_total_budget_into_a_per_kind_budget_starts_its_multipliers_afresh(tmp_path):
    # one multiplier pair (total) in the source, three (one per kind) in the fork: the weights, gates and their
    # optimiser state carry over, the multipliers and their optimiser state start again, and the fork meets its targets
    common = ("experiment=smoke", "export.enabled=true", "pruning=l0_budget")
    train(compose_train(tmp_path / "total", *common, "pruning.target_heads=10", "trainer.max_steps=14",
                        "export.enabled=false"))
    metrics = train(compose_train(tmp_path / "kinds", *common, "pruning.target_heads={encoder:2,decoder:3,cross:4}",
                                  "trainer.max_steps=18", f"resume={tmp_path / 'total' / 'checkpoints' / 'last.ckpt'}"))
    assert metrics["steps"] == 18
    assert {k: metrics["heads_alive"][k] for k in ("encoder", "decoder", "cross")} == {"encoder": 2, "decoder": 3, "cross": 4}
    state = torch.load(tmp_path / "kinds" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["state_dict"]["budget.lambda1"].shape == (3,)
