"""Hard-concrete gates (Louizos, Welling & Kingma 2018), one per attention head.

A gate is parameterised by ``log_alpha``. With stretch limits (gamma, zeta) and temperature beta:

- sample (training):  u ~ U(eps, 1-eps),  s = sigmoid((log u - log(1-u) + log_alpha) / beta),
                      g = clamp(s * (zeta - gamma) + gamma, 0, 1)
- P(g != 0):          sigmoid(log_alpha - beta * log(-gamma / zeta))   (the expected L0, differentiable)
- deterministic:      clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)
- binary (Voita et al. 2019): open iff log_alpha > 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

GATE_MODES = ("sample", "deterministic", "binary", "open")
# errors name the config key a user sets these by (a run's pruning.gates.*, a checkpoint's copy of it)
OPTIONS_KEY = "pruning.gates"


@dataclass(frozen=True)
class GateOptions:
    """Constants of the hard-concrete distribution; defaults follow Voita et al.'s code."""

    temperature: float = 0.33  # beta; Louizos et al. use 2/3
    stretch: tuple[float, float] = (-0.1, 1.1)  # (gamma, zeta)
    eps: float = 1e-6  # keeps the uniform noise away from 0 and 1
    init_log_alpha: float = 3.0  # open: deterministic gate 1, P(open) ~ 0.98 at beta 0.33
    log_alpha_range: tuple[float, float] = (-10.0, 10.0)  # clamp after each step, so gates stay finite

    def __post_init__(self) -> None:
        for name in ("temperature", "stretch", "eps", "init_log_alpha", "log_alpha_range"):
            value = getattr(self, name)
            if not all(math.isfinite(v) for v in (value if isinstance(value, (tuple, list)) else [value])):
                raise ValueError(f"{OPTIONS_KEY}.{name}={value}: gate {name} must be finite, got {value}")
        gamma, zeta = self.stretch
        if not self.temperature > 0:
            raise ValueError(f"{OPTIONS_KEY}.temperature={self.temperature}: gate temperature must be > 0, got "
                             f"{self.temperature}")
        if not (gamma < 0 and zeta > 1):
            raise ValueError(f"{OPTIONS_KEY}.stretch={list(self.stretch)}: gate stretch (gamma, zeta) must satisfy "
                             f"gamma < 0 < 1 < zeta, got {tuple(self.stretch)}")
        if not 0 < self.eps < 0.5:
            raise ValueError(f"{OPTIONS_KEY}.eps={self.eps}: gate eps must lie in (0, 0.5), got {self.eps}")
        low, high = self.log_alpha_range
        if not low < high:
            raise ValueError(f"{OPTIONS_KEY}.log_alpha_range={list(self.log_alpha_range)}: log_alpha_range must be "
                             f"(low, high) with low < high, got {tuple(self.log_alpha_range)}")


# |log_alpha| of a gate decided and held (HeadGates.hold_): with the default stretch its deterministic value is
# exactly 0 or 1 and P(open) about 1e-4 from it
HELD = 10.0


def decided(kept) -> torch.Tensor:
    """The log_alpha of gates decided open (True) or closed (False), one per entry of ``kept``: +-HELD.  # (H,)"""
    return torch.where(torch.as_tensor(kept, dtype=torch.bool), HELD, -HELD)


class HardConcreteGate(nn.Module):
    """``num_heads`` independent hard-concrete gates for one attention module."""

    def __init__(self, num_heads: int, options: GateOptions = GateOptions()):
        super().__init__()
        self.options = options
        self.log_alpha = nn.Parameter(torch.full((num_heads,), float(options.init_log_alpha)))

    @property
    def num_heads(self) -> int:
        return self.log_alpha.numel()

    def sample(self) -> torch.Tensor:
        """One stochastic gate value per head, differentiable in ``log_alpha``.  # (H,)"""
        gamma, zeta = self.options.stretch
        eps = self.options.eps
        u = torch.rand_like(self.log_alpha).clamp(eps, 1 - eps)
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + self.log_alpha) / self.options.temperature)
        return (s * (zeta - gamma) + gamma).clamp(0.0, 1.0)

    def deterministic(self) -> torch.Tensor:
        """Test-time gate: the stretched sigmoid of ``log_alpha``, clipped.  # (H,)"""
        gamma, zeta = self.options.stretch
        return (torch.sigmoid(self.log_alpha) * (zeta - gamma) + gamma).clamp(0.0, 1.0)

    def binary(self) -> torch.Tensor:
        """Voita et al.'s rule: a head is kept iff P(g=1) > P(g=0), i.e. ``log_alpha > 0``.  # (H,)"""
        return (self.log_alpha > 0).to(self.log_alpha.dtype)

    def p_open(self) -> torch.Tensor:
        """P(g != 0) per head: the expected L0 contribution, differentiable.  # (H,)"""
        gamma, zeta = self.options.stretch
        return torch.sigmoid(self.log_alpha - self.options.temperature * math.log(-gamma / zeta))

    def value(self, mode: str, training: bool) -> torch.Tensor:
        """The gate to multiply head outputs with; ``sample`` draws noise only while ``training``."""
        if mode == "sample":
            return self.sample() if training else self.deterministic()
        if mode == "deterministic":
            return self.deterministic()
        if mode == "binary":
            return self.binary()
        if mode == "open":
            return torch.ones_like(self.log_alpha)
        raise ValueError(f"unknown gate mode {mode!r}; allowed: {', '.join(GATE_MODES)}")

    @torch.no_grad()
    def clamp_(self) -> None:
        self.log_alpha.clamp_(*self.options.log_alpha_range)
