"""What every format is checked against: the PyTorch model's own greedy tokens on the verification batch.

A runtime's tokens are compared as lists of ids, from the first generated token up to (not including) the first
EOS: each runtime frames its output differently (``generate()`` returns the start token and pads; CTranslate2
returns neither start nor EOS). ``generate()`` runs with a generation config of the model's framing only (decoder
start, EOS, pad, a forced first token): none of the rest (a forced EOS at the length limit, repetition rules,
suppressed tokens, a minimum length), which a runtime is given separately, if at all.
"""

from __future__ import annotations

import torch
import transformers
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


def eos_ids(model: nn.Module) -> list[int]:
    """Every id generation stops at: the generation config's (a list for some models), else the config's."""
    eos = model.generation_config.eos_token_id
    eos = model.config.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def until_eos(ids: list[int], eos: int | list[int]) -> list[int]:
    """``ids`` up to (not including) the first of the ``eos`` ids."""
    stops = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
    return ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]


@torch.no_grad()
def greedy_reference(model: nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The PyTorch model's greedy tokens per row (generated tokens only, up to the first EOS)."""
    device = next(model.parameters()).device
    framing = transformers.GenerationConfig(
        decoder_start_token_id=decoder_start(model), eos_token_id=eos_ids(model),
        pad_token_id=model.config.pad_token_id, forced_bos_token_id=forced_first(model),
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
    )
    # generate() fills what a config it is given leaves at a default from the model's own: so the framing stands in
    # for the model's own during the call
    own, model.generation_config = model.generation_config, framing
    try:
        out = model.generate(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    finally:
        model.generation_config = own
    out = out.cpu()  # (B, 1 + T): the decoder start, then the generated tokens
    return [until_eos(row[1:].tolist(), eos_ids(model)) for row in out]


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
