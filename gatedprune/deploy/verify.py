"""What every format is checked against: the PyTorch model's own greedy tokens on the verification batch.

A runtime's tokens are compared as lists of ids, from the first generated token up to (not including) the first
EOS: each runtime frames its output differently (``generate()`` returns the start token and pads; CTranslate2
returns neither start nor EOS). ``generate()`` runs with the generation config's framing (decoder start, a forced
first token) and nothing else: no forced EOS at the length limit, no repetition rules, no minimum length, which
no other runtime applies.
"""

from __future__ import annotations

import torch
from torch import nn

from gatedprune.errors import RunFailed


class DeployError(RunFailed):
    """A converted model does not give the PyTorch model's outputs; the one-line message says what differed."""


def sources(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """The unpadded source ids of each row of ``batch``."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


def forced_first(model: nn.Module) -> int | None:
    """The token ``generate()`` forces first (a target-language code), or None."""
    return getattr(model.generation_config, "forced_bos_token_id", None)


def decoder_start(model: nn.Module) -> int:
    config = model.generation_config
    start = config.decoder_start_token_id
    return model.config.decoder_start_token_id if start is None else start


def until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


@torch.no_grad()
def greedy_reference(model: nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The PyTorch model's greedy tokens per row (generated tokens only, up to the first EOS)."""
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, num_beams=1,
        forced_eos_token_id=None, no_repeat_ngram_size=0, repetition_penalty=1.0, bad_words_ids=None,
        begin_suppress_tokens=None, suppress_tokens=None,
    ).cpu()  # (B, 1 + T): the decoder start, then the generated tokens
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return [until_eos(row[1:].tolist(), eos) for row in out]


def compare_tokens(name: str, got: list[list[int]], want: list[list[int]]) -> dict:
    """``{"greedy_identical", "greedy_sequences", "first_difference"}``: where ``got`` first left ``want``."""
    differing = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    first = None
    if differing:
        i = differing[0]
        at = next((t for t, (g, w) in enumerate(zip(got[i], want[i])) if g != w), min(len(got[i]), len(want[i])))
        first = {"sequence": i, "position": at, name: got[i][at: at + 5], "pytorch": want[i][at: at + 5]}
    return {"greedy_identical": not differing, "greedy_sequences": len(want), "differing_sequences": len(differing),
            "first_difference": first}


def describe_difference(name: str, check: dict) -> str:
    first = check["first_difference"]
    return (f"{check['differing_sequences']} of {check['greedy_sequences']} greedy sequences differ from the PyTorch "
            f"model's; the first, sequence {first['sequence']} at token {first['position']}: {name} "
            f"{first[name]}, pytorch {first['pytorch']}")
