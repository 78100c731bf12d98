"""The hard-concrete formulas, checked numerically against their definitions."""

import math

import pytest
import torch

from gatedprune.structures.hard_concrete import GateOptions, HardConcreteGate


def _gate(values, **options) -> HardConcreteGate:
    gate = HardConcreteGate(len(values), GateOptions(**options))
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor(values))
    return gate


@pytest.mark.parametrize("temperature", [0.33, 2 / 3])
def test_p_open_matches_monte_carlo_of_sampler(temperature):
    torch.manual_seed(0)
    gate = _gate([-3.0, -1.0, 0.0, 0.5, 2.0], temperature=temperature)
    with torch.no_grad():
        samples = torch.stack([gate.sample() for _ in range(40_000)])  # (N, H)
    empirical = (samples > 0).float().mean(0)
    # binomial standard error is at most 0.0025 for 40k draws
    torch.testing.assert_close(empirical, gate.p_open().detach(), atol=0.01, rtol=0)


def test_p_open_closed_form():
    gate = _gate([0.0, 1.5])
    expected = torch.sigmoid(torch.tensor([0.0, 1.5]) - 0.33 * math.log(0.1 / 1.1))
    torch.testing.assert_close(gate.p_open().detach(), expected)
    # with beta 0.33 the shift is +0.791 (methods note)
    assert gate.p_open()[0].item() == pytest.approx(1 / (1 + math.exp(-0.7913)), abs=1e-4)


def test_deterministic_gate_is_the_clipped_stretched_sigmoid():
    values = torch.linspace(-6, 6, 49)
    gate = _gate(values.tolist())
    expected = (torch.sigmoid(values) * 1.2 - 0.1).clamp(0, 1)
    torch.testing.assert_close(gate.deterministic().detach(), expected)
    # exactly 0 when sigmoid(log_alpha) <= 1/12 and exactly 1 when >= 11/12
    s = torch.sigmoid(values)
    assert torch.all(gate.deterministic()[s <= 1 / 12] == 0)
    assert torch.all(gate.deterministic()[s >= 11 / 12] == 1)


def test_sample_lies_in_unit_interval_with_exact_zeros_and_ones():
    torch.manual_seed(1)
    gate = _gate([0.0] * 4)
    samples = torch.stack([gate.sample() for _ in range(5000)]).detach()
    assert samples.min() == 0 and samples.max() == 1
    assert ((samples > 0) & (samples < 1)).any()


def test_binary_rule_is_log_alpha_positive():
    gate = _gate([-0.1, 0.0, 0.1, 5.0])
    assert gate.binary().tolist() == [0.0, 0.0, 1.0, 1.0]


def test_gradients_reach_log_alpha_through_sample_and_p_open():
    torch.manual_seed(2)
    gate = _gate([0.3, -0.2, 1.0])
    (gate.sample().sum() + gate.p_open().sum()).backward()
    assert gate.log_alpha.grad is not None and torch.all(gate.log_alpha.grad != 0)


def test_default_init_is_open():
    gate = HardConcreteGate(3)
    assert torch.all(gate.deterministic() == 1) and torch.all(gate.binary() == 1)
    assert torch.all(gate.p_open() > 0.95)


def test_clamp_keeps_log_alpha_in_range():
    gate = _gate([-50.0, 0.0, 50.0], log_alpha_range=(-4.6, 4.6))
    gate.clamp_()
    assert gate.log_alpha.tolist() == pytest.approx([-4.6, 0.0, 4.6])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"stretch": (0.1, 1.1)}, "gamma < 0 < 1 < zeta, got (0.1, 1.1)"),
        ({"stretch": (-0.1, 0.9)}, "gamma < 0 < 1 < zeta, got (-0.1, 0.9)"),
        ({"log_alpha_range": (3, -3)}, "low < high"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GateOptions(**options)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown gate mode 'soft'; allowed: sample, deterministic, binary, open"):
        HardConcreteGate(2).value("soft", training=True)
