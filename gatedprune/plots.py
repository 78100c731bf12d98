"""Pictures of gates: a layer x head heatmap, one panel per attention kind."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gatedprune.gating import HeadGates  # noqa: E402


@torch.no_grad()
def save_gate_heatmap(gates: HeadGates, path: Path, step: int | None = None) -> Path:
    """Save P(open) per head as a heatmap; heads that the binary rule removes are marked with a cross."""
    kinds = list(dict.fromkeys(gates.kinds))
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1, 3), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = [(layer, gate) for gate, k, layer in zip(gates.gates, gates.kinds, gates.layers) if k == kind]
        p_open = torch.stack([gate.p_open() for _, gate in rows]).cpu()  # (L, H)
        image = ax.imshow(p_open, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        closed = torch.stack([gate.log_alpha <= 0 for _, gate in rows]).cpu()
        ys, xs = torch.nonzero(closed, as_tuple=True)
        ax.scatter(xs, ys, marker="x", color="red", s=30)
        ax.set_title(f"{kind}: {int((~closed).sum())}/{closed.numel()} kept")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(p_open.shape[1]))
        ax.set_yticks(range(p_open.shape[0]), [str(layer) for layer, _ in rows])
    fig.colorbar(image, ax=axes[0].tolist(), label="P(open)")
    if step is not None:
        fig.suptitle(f"gates at step {step} (x: removed by log_alpha <= 0)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
