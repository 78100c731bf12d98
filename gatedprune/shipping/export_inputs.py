"""What ``gatedprune-export`` is handed, checked before anything loads: the run directory's own checkpoint (never
another run's file), a record of which file it read, the pairs to verify on and the device to verify on."""

from __future__ import annotations

import json
from pathlib import Path

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from gatedprune.utils import file_sha256

Pairs = Sequence[tuple[str, str]]


def find_run_files(source: Path) -> tuple[Path, Path | None]:
    """(checkpoint, run dir) of a run directory or of a checkpoint path inside one.

    A run directory's own checkpoint only: the one its metrics.json names relative to it, else
    ``checkpoints/last.ckpt``. A path the record names outside the run (older runs recorded absolute paths) is
    never read: a copy of a run would export the original's model, retrained since, say.
    """
    own = source / "checkpoints" / "last.ckpt"
    if not source.is_dir():
        if not source.is_file():
            raise FileNotFoundError(f"no run directory or checkpoint at {source}")
        run_dir = next((d for d in source.parents if (d / "metrics.json").exists()), None)
        if run_dir is None and source.parent.name == "checkpoints":  # a run still going: no metrics.json yet
            run_dir = source.parent.parent
        return source, run_dir
    metrics = source / "metrics.json"
    if not metrics.is_file():  # a run still going, or one that stopped: its last checkpoint
        if own.is_file():
            return own, source
        raise FileNotFoundError(
            f"{source} holds neither metrics.json nor checkpoints/last.ckpt; give a run directory or a .ckpt file"
        )
    try:
        recorded = Path(json.loads(metrics.read_text())["checkpoint"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{metrics} is not a metrics.json written by train.py (no checkpoint named)") from None
    inside = not recorded.is_absolute() and ".." not in recorded.parts
    # as recorded (relative to the run), the recorded file moved along with the run (an old absolute record), the last
    candidates = list(dict.fromkeys([*([source / recorded] if inside else []), source / "checkpoints" / recorded.name,
                                     own]))
    checkpoint = next((c for c in candidates if c.is_file()), None)
    if checkpoint is None:
        outside = "" if inside else f"; metrics.json names {recorded}, outside the run, which is never read for it"
        raise FileNotFoundError(f"run directory {source} has no checkpoint of its own: none at "
                                f"{', '.join(map(str, candidates))}{outside}")
    return checkpoint, source


def file_record(path: Path) -> dict:
    """``{"path", "sha256"}`` of the checkpoint an export read: which file, and which contents of it."""
    return {"path": str(path.resolve()), "sha256": file_sha256(path)}


def check_device(device: str | None) -> None:
    """Refuse a device this machine does not have, before anything loads (torch's own error is a traceback)."""
    if device is None:  # the model's own
        return
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    allowed = ", ".join(["cpu", *(["cuda", *(f"cuda:{i}" for i in range(cuda))] if cuda else []),
                         *(["mps"] if torch.backends.mps.is_available() else [])])
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device} is not a device; allowed: {allowed}") from None
    if parsed.type == "cuda" and (not cuda or (parsed.index or 0) >= cuda):
        have = f"{cuda} CUDA device{'s' * (cuda != 1)}" if cuda else "no CUDA device"
        raise ValueError(f"--device {device} is not available here ({have}); allowed: {allowed}")
    if parsed.type not in ("cpu", "cuda") and not (parsed.type == "mps" and torch.backends.mps.is_available()):
        raise ValueError(f"--device {device} is not available here; allowed: {allowed}")


def check_counts(samples: int, max_new_tokens: int) -> None:
    """``--samples`` and ``--max-new-tokens`` of an export: 0 or fewer would verify on nothing (or on every pair:
    ``read_pairs`` takes -1 as no limit)."""
    for name, value in (("samples", samples), ("max-new-tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"--{name}={value} is below 1; allowed: a whole number >= 1")


def read_pairs(path: Path, limit: int) -> list[tuple[str, str]]:
    """The first ``limit`` (source, target) pairs of a JSON-lines file with "source" and "target" fields."""
    pairs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                    pairs.append((str(row["source"]), str(row["target"])))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with source and target") from None
            if len(pairs) == limit:
                break
    return pairs


def sample_batch(
    model: nn.Module,
    tokenizer=None,
    sample_inputs: Mapping[str, torch.Tensor] | Pairs | None = None,
    *,
    num_random: int = 4,
    max_length: int = 128,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The verification batch: given tensors, tokenized (source, target) pairs, or random ids when none are given."""
    if isinstance(sample_inputs, Mapping):
        return {name: torch.as_tensor(value) for name, value in sample_inputs.items()}
    if sample_inputs is not None:
        if tokenizer is None:
            raise ValueError("text pairs as sample inputs need a tokenizer")
        sources, targets = zip(*sample_inputs)
        batch = tokenizer(
            list(sources), text_target=list(targets), padding=True, truncation=True, max_length=max_length,
            return_tensors="pt",
        )
        return dict(batch)  # input_ids, attention_mask, labels (the model shifts labels into decoder inputs)
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(config.vocab_size, (num_random, 16), generator=generator)  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, input_ids.shape[1] // 2 :] = 0  # one padded row, so the masks are exercised too
    decoder_input_ids = torch.randint(config.vocab_size, (num_random, 12), generator=generator)  # (B, T)
    if config.decoder_start_token_id is not None:
        decoder_input_ids[:, 0] = config.decoder_start_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}
