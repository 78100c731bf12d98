"""gatedprune: learn which attention heads of a seq2seq Transformer can go, then remove them."""

from gatedprune import moved

moved.install()  # the old module paths (gatedprune.baselines, ...) from one table

from gatedprune.methods.importance import head_importance
from gatedprune.shipping.export import export_gated
from gatedprune.shipping.export_dir import save_pruned
from gatedprune.structures.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.structures.hard_concrete import GateOptions, HardConcreteGate
from gatedprune.structures.head_gates import HeadGates, attach_gates
from gatedprune.surgery.cut import prune_heads
from gatedprune.surgery.model_loading import load_pruned

__all__ = [
    "ATTENTION_KINDS", "GateOptions", "HardConcreteGate", "HeadGates", "attach_gates", "attention_sites",
    "export_gated", "head_importance", "load_pruned", "prune_heads", "save_pruned",
]
