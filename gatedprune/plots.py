"""Pictures of gates: a layer x head heatmap, one panel per attention kind."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gatedprune.head_gates import HeadGates  # noqa: E402


@torch.no_grad()
def save_gate_heatmap(gates: HeadGates, path: Path, step: int | None = None) -> Path:
    """Save P(open) per head as a heatmap; heads that the binary rule removes are marked with a cross."""
    p_open = gates.by_kind([gate.p_open().cpu() for gate in gates.gates])
    kept = gates.by_kind([gate.binary().cpu().bool() for gate in gates.gates])
    # constrained layout keeps the title, panel titles, axis labels and colour bar clear of each other
    fig, axes = plt.subplots(1, len(p_open), figsize=(3.4 * len(p_open) + 1.2, 3.6), squeeze=False,
                             layout="constrained")
    for ax, kind in zip(axes[0], p_open):
        rows = p_open[kind]
        image = ax.imshow(torch.stack([v for _, v in rows]), vmin=0, vmax=1, cmap="viridis", aspect="auto")  # (L, H)
        closed = ~torch.stack([v for _, v in kept[kind]])
        ys, xs = torch.nonzero(closed, as_tuple=True)
        ax.scatter(xs, ys, marker="x", color="red", s=30)
        ax.set_title(f"{kind}: {int((~closed).sum())}/{closed.numel()} kept")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(closed.shape[1]))
        ax.set_yticks(range(closed.shape[0]), [str(layer) for layer, _ in rows])
    fig.colorbar(image, ax=axes[0].tolist(), label="P(open)")
    if step is not None:
        fig.suptitle(f"gates at step {step} (x: removed by log_alpha <= 0)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
