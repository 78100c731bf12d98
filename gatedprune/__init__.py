"""gatedprune: learn which attention heads of a seq2seq Transformer can go, then remove them."""

from gatedprune.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.gates import GateOptions, HardConcreteGate
from gatedprune.gating import HeadGates, attach_gates

__all__ = ["ATTENTION_KINDS", "GateOptions", "HardConcreteGate", "HeadGates", "attach_gates", "attention_sites"]
