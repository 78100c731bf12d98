"""Token-budget batches, an epoch order that resumes exactly, and padding."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

Pair = tuple[str, str]

def token_budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that every batch has len(batch) * max(length in batch) <= max_tokens."""
    batches, batch, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):  # stable: ties keep index order
        if batch and (len(batch) + 1) * max(longest, lengths[i]) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    if batch:
        batches.append(batch)
    return batches


class EpochShuffle(Sampler[int]):
    """A permutation of range(n) drawn from (seed, epoch) only, so a resumed run replays the same order.

    Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler`` at the start of every epoch. ``skip``
    drops the first batches of the next pass only: those a resumed run already trained on before it stopped.
    With ``world_size`` > 1 (DDP) process ``rank`` takes every world_size-th item of the permutation, after
    dropping the last n % world_size so that every process takes the same number of steps.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0, skip: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} with world_size={world_size}; allowed: 0 <= rank < world_size")
        self.n, self.seed, self.epoch, self.skip = n, seed, epoch, skip
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        order = order[self.rank : len(self) * self.world_size : self.world_size]
        skip, self.skip = self.skip, 0
        return iter(order[skip:])

    def __len__(self) -> int:
        return self.n // self.world_size


class FixedBatches(Sampler[list[int]]):
    """Precomputed batches of dataset indices, yielded in the order of ``sampler`` (which yields batch numbers)."""

    def __init__(self, batches: list[list[int]], sampler: Iterable[int]) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[list[int]]:
        return (self.batches[b] for b in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class TokenizedPairs(Dataset):
    """Token ids and raw strings of one split; item i is (src_ids, tgt_ids, src_text, tgt_text)."""

    def __init__(self, pairs: list[Pair], src_ids: list[list[int]], tgt_ids: list[list[int]]) -> None:
        self.pairs, self.src_ids, self.tgt_ids = pairs, src_ids, tgt_ids

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[list[int], list[int], str, str]:
        return self.src_ids[i], self.tgt_ids[i], *self.pairs[i]


def _padded(sequences: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(sequences), max(map(len, sequences))), value, dtype=torch.long)
    for row, ids in enumerate(sequences):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def collate_pairs(items: list[tuple], pad_id: int, with_texts: bool) -> dict:
    """Right-padded ``input_ids``/``attention_mask`` (B, S) and ``labels`` (B, T) with -100 on padding."""
    src_ids, tgt_ids, src_texts, tgt_texts = zip(*items)
    input_ids = _padded(src_ids, pad_id)  # (B, S)
    batch = {
        "input_ids": input_ids,
        "attention_mask": _padded([[1] * len(ids) for ids in src_ids], 0),  # (B, S)
        "labels": _padded(tgt_ids, -100),  # (B, T)
    }
    if with_texts:
        batch.update(src_texts=list(src_texts), tgt_texts=list(tgt_texts))
    return batch
