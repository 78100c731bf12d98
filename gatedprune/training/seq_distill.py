"""Sequence-level distillation (Kim and Rush 2016): fine-tune on the dense model's translations.

``finetune.targets=dense_greedy``: the exported model fine-tunes on the dense model's greedy translations of the
training sources instead of the references (as Distil-Whisper and deep-encoder/shallow-decoder students do);
validation and the test split keep the references. The dense model is the weights the gated phase started from:
the teacher (``GatedSeq2Seq.teacher``, kept for this alone when nothing distils: ``Method.keeps_dense``), or, for a
method that never trains the model (it scores a trained one), that model with its gates removed (``dense_model``).

The translations are made once and cached in ``<finetune.cache_dir>/seqkd-<key>.jsonl`` (one ``{"source",
"target"}`` line per training pair, in order, written atomically), the key hashing the dense weights, the tokenised
training sources and the generation settings: a relaunch, another level of the same run, or a run pointed at the
same cache directory reuses it, and a changed teacher or data makes a new one.

``finetune.targets`` names a row of ``TARGETS``: greedy or beam search (``BEAM`` beams), the translations alone or
beside the references (``both_*``: every reference, and a second pair per translated source). ``finetune.targets_max``
translates only the first N training sources (generation is the costly part): the translations then train on those
N alone, or beside every reference.

Generation: greedy (``num_beams=1``) or ``BEAM`` beams, at most ``data.max_length`` new tokens (the longest target that trains),
batches of ``data.eval_batch_size`` sources sorted by length; each target is re-tokenised as references are (and cut
to ``data.max_length``), and the training batches are rebuilt to the token budget.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from gatedprune.utils import atomic_write_text

BEAM = 4  # beams of the *_beam targets (Kim and Rush 2016 distil from beam search)


@dataclass(frozen=True)
class Targets:
    """What a fine-tune trains on: the dense model's translations made with ``num_beams``, with the references
    kept beside them or not."""

    num_beams: int
    references: bool


# finetune.targets: labels (the references alone) or one of these rows
TARGETS = {"labels": None,
           "dense_greedy": Targets(num_beams=1, references=False),
           "dense_beam": Targets(num_beams=BEAM, references=False),
           "both_greedy": Targets(num_beams=1, references=True),
           "both_beam": Targets(num_beams=BEAM, references=True)}


def dense_model(module) -> nn.Module:
    """The dense model of a run's ``GatedSeq2Seq`` ``module``: its teacher once loaded (the gated phase's starting
    weights), else, when no gated step trained the weights (a method that scores a trained model, or a dense run),
    the model itself without its gates."""
    if module.teacher is not None and module._teacher_ready:
        return module.teacher
    if not module.gates_trained:
        from gatedprune.shipping.export import dense_copy

        return dense_copy(module.model)
    raise ValueError("finetune.targets (the dense model's translations) or finetune.distill_alpha: the gated model "
                     "trained past its dense weights and no copy of them was kept; allowed: a run set up by train.py "
                     "(it keeps one), or finetune.targets=labels without finetune.distill_alpha")


def weights_digest(model: nn.Module) -> str:
    """sha256 of ``model``'s state: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def settings(datamodule, num_beams: int = 1) -> dict:
    """The generation settings of the targets (part of the cache key)."""
    return {"num_beams": num_beams, "max_new_tokens": datamodule.max_length, "batch_size": datamodule.eval_batch_size}


def cache_path(dense: nn.Module, datamodule, cache_dir: str | Path, num_beams: int = 1,
               limit: int | None = None) -> Path:
    """Where the targets of ``dense`` for ``datamodule``'s training split (its first ``limit`` sources) are cached."""
    key = hashlib.sha256()
    key.update(weights_digest(dense).encode())
    key.update(json.dumps(datamodule.datasets["train"].src_ids[:limit]).encode())
    key.update(json.dumps(settings(datamodule, num_beams), sort_keys=True).encode())
    # what else decides the translations: the model's own generation defaults (forced BOS, lengths) and the tokenizer
    key.update(json.dumps(dense.generation_config.to_diff_dict(), sort_keys=True, default=str).encode())
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is not None:
        key.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return Path(cache_dir) / f"seqkd-{key.hexdigest()[:16]}.jsonl"


@torch.no_grad()
def translations(model: nn.Module, tokenizer, src_ids: list[list[int]], batch_size: int, max_new_tokens: int,
                 num_beams: int = 1) -> list[str]:
    """``model``'s translations (greedy, or beam search with ``num_beams``) of the tokenised sources, in their
    order, decoded without special tokens.

    Batches of ``batch_size`` sources of similar length (right-padded), on ``model``'s device, with a progress bar.
    """
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    texts: list[str | None] = [None] * len(src_ids)
    desc = "dense model's greedy targets" if num_beams == 1 else f"dense model's beam-{num_beams} targets"
    with tqdm(total=len(src_ids), desc=desc, unit="sentence") as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            longest = max(len(src_ids[i]) for i in chunk)
            input_ids = torch.full((len(chunk), longest), tokenizer.pad_token_id, dtype=torch.long)  # (B, S)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(chunk):
                input_ids[row, : len(src_ids[i])] = torch.tensor(src_ids[i])
                attention_mask[row, : len(src_ids[i])] = 1
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens)  # (B, T)
            for i, text in zip(chunk, tokenizer.batch_decode(out, skip_special_tokens=True)):
                texts[i] = text
            bar.update(len(chunk))
    model.train(training)
    return texts


def _read_cache(path: Path, sources: list[str]) -> list[str] | None:
    """The cached targets, if ``path`` holds one line per source, the same sources in the same order."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if [row["source"] for row in rows] == sources and all(isinstance(row["target"], str) for row in rows):
            return [row["target"] for row in rows]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"note: {path} does not hold this run's targets; they are made again")
    return None


def sequence_targets(dense: nn.Module, datamodule, cache_dir: str | Path, device: torch.device | None = None,
                     num_beams: int = 1, limit: int | None = None) -> list[str]:
    """The dense model's translation (``num_beams``: 1 greedy) of every training source of ``datamodule`` (set up),
    or of its first ``limit``, from the cache when it holds them, else generated (on ``device``, default
    ``dense``'s) and cached."""
    dataset = datamodule.datasets["train"]
    sources = [src for src, _ in dataset.pairs][:limit]
    path = cache_path(dense, datamodule, cache_dir, num_beams, limit)
    what = "greedy" if num_beams == 1 else f"beam-{num_beams}"
    if path.is_file() and (cached := _read_cache(path, sources)) is not None:
        print(f"sequence-level targets: the dense model's {what} translations, from {path}")
        return cached
    home = next(dense.parameters()).device
    dense.to(device or home)
    options = settings(datamodule, num_beams)
    try:
        texts = translations(dense, datamodule.tokenizer, dataset.src_ids[:limit], options["batch_size"],
                             options["max_new_tokens"], num_beams)
    finally:
        dense.to(home)
    atomic_write_text(path, "".join(json.dumps({"source": s, "target": t}, ensure_ascii=False) + "\n"
                                    for s, t in zip(sources, texts)))
    print(f"sequence-level targets: the dense model's {what} translations of {len(texts)} training sources, "
          f"cached in {path}")
    return texts
