"""Small helpers shared by the run, the exporter and the sweep summary."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

GATED_CHECKPOINT_KEYS = ("state_dict", "hf_config", "gate_kinds", "gate_options")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_table(header: list[str], rows: list[tuple]) -> str:
    """A plain-text table with aligned columns."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[tuple]) -> str:
    """A Markdown table, one line per row."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def load_gated_checkpoint_file(path: str | Path) -> dict:
    """A Lightning checkpoint of a gated run, loaded on CPU; ``ValueError`` naming the file if it is not one."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated or corrupt: torch raises several types depending on where it breaks
        raise ValueError(f"{path} is not a readable checkpoint ({type(err).__name__}); it may be truncated") from None
    missing = [key for key in GATED_CHECKPOINT_KEYS if key not in checkpoint]
    if missing or not any(key.startswith("gates.") for key in checkpoint["state_dict"]):
        raise ValueError(
            f"{path} is not a checkpoint of a gated run (missing {missing or ['gates.*']}); "
            "give a checkpoint written by gatedprune's train.py"
        )
    return checkpoint
