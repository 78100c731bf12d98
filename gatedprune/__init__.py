"""gatedprune: learn which attention heads of a seq2seq Transformer can go, then remove them."""

from gatedprune.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.gates import GateOptions, HardConcreteGate
from gatedprune.gating import HeadGates, attach_gates

__all__ = ["ATTENTION_KINDS", "GateOptions", "HardConcreteGate", "HeadGates", "attach_gates", "attention_sites"]

from gatedprune.surgery import load_pruned, prune_heads  # noqa: E402

__all__ += ["export_gated", "load_pruned", "prune_heads", "save_pruned"]


def __getattr__(name: str):
    # the exporter loads on first use, so `python -m gatedprune.export` does not find itself imported already
    if name in ("export_gated", "save_pruned"):
        from gatedprune import export

        return getattr(export, name)
    raise AttributeError(f"module 'gatedprune' has no attribute {name!r}")
