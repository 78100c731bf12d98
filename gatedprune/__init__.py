"""gatedprune: learn which attention heads of a seq2seq Transformer can go, then remove them."""

from gatedprune.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.export import export_gated
from gatedprune.export_dir import save_pruned
from gatedprune.hard_concrete import GateOptions, HardConcreteGate
from gatedprune.head_gates import HeadGates, attach_gates
from gatedprune.surgery import load_pruned, prune_heads

__all__ = [
    "ATTENTION_KINDS", "GateOptions", "HardConcreteGate", "HeadGates", "attach_gates", "attention_sites",
    "export_gated", "load_pruned", "prune_heads", "save_pruned",
]
