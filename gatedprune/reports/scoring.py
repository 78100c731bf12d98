"""Score a seq2seq model: sacreBLEU BLEU and chrF, loss, the decoding used and how fast it ran.

The primitives every part of a run scores with: validation and the test split in training, distillation's and
importance's teacher-forced passes, fine-tuning, the baselines' masked models, and ``gatedprune-evaluate``
(``gatedprune.reports.evaluate``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import sacrebleu
import torch
import torch.nn.functional as F

from gatedprune.utils import check_numbers


@dataclass
class GenerationConfig:
    """Decoding for BLEU/chrF: validation (``generation``) and the test split (``test_generation``)."""

    num_beams: int = 1
    max_new_tokens: int = 96
    length_factor: float = 1.5  # at most length_factor * source length + 10 new tokens
    log_examples: int = 3
    batch_size: int | None = None  # sentences per batch; None: data.eval_batch_size
    extra: dict = field(default_factory=dict)  # passed to generate() as is

    def __post_init__(self) -> None:
        check_numbers("generation", self)
        if self.num_beams < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise ValueError(f"generation num_beams={self.num_beams}, batch_size={self.batch_size}; allowed: >= 1")

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "log_examples"}


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, gen: GenerationConfig) -> torch.Tensor:
    """Token ids of the translations, deterministic (greedy or beam).  # (B, T)"""
    max_new = min(gen.max_new_tokens, int(gen.length_factor * input_ids.shape[1]) + 10)
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, num_beams=gen.num_beams, max_new_tokens=max_new,
        do_sample=False, **gen.extra,
    )


def corpus_scores(hyps: list[str], refs: list[str]) -> dict:
    """sacreBLEU BLEU and chrF of a whole split, with their signatures."""
    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    return {
        "bleu": bleu.corpus_score(hyps, [refs]).score,
        "chrf": chrf.corpus_score(hyps, [refs]).score,
        "sacrebleu_signature": {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())},
    }


def teacher_forced_inputs(model, batch: dict) -> dict:
    """The keyword arguments of a teacher-forced forward pass over ``batch`` (``labels``: (B, T), -100 on padding)."""
    labels = batch["labels"]
    # decoder inputs as the family's own forward builds them from labels (mBART starts with the EOS it wraps);
    # building them here spares the cross-entropy the model would compute when given labels
    shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    targets = {"decoder_input_ids": shift(labels=labels)} if shift is not None else {"labels": labels}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **targets}


def teacher_forced_logits(model, batch: dict) -> torch.Tensor:
    """The model's next-token logits for the targets of ``batch``.  # (B, T, V)"""
    return model(**teacher_forced_inputs(model, batch)).logits


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy per target token; ``labels`` -100 on padding.  logits: (B, T, V), labels: (B, T)"""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing, reduction=reduction)


def token_cross_entropy(model, batch: dict, label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Teacher-forced cross-entropy per target token."""
    return cross_entropy(teacher_forced_logits(model, batch), batch["labels"], label_smoothing, reduction)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # the process's peak resident set (KiB)


@torch.no_grad()
def score(model, tokenizer, batches: Iterable[dict], gen: GenerationConfig) -> dict:
    """BLEU, chrF and loss of ``model`` on ``batches`` (with ``tgt_texts``), decoded by ``gen``, and its speed.

    Speed counts the decoding alone: sentences and generated tokens per second of ``generate``.
    """
    model.eval()
    device = next(model.parameters()).device
    hyps, refs, loss, tokens, generated, seconds = [], [], 0.0, 0, 0, 0.0
    for batch in batches:
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss += token_cross_entropy(model, batch, reduction="sum").item()
        tokens += int((batch["labels"] != -100).sum())
        start = time.perf_counter()
        out = generate(model, batch["input_ids"], batch["attention_mask"], gen)  # (B, T)
        seconds += time.perf_counter() - start
        generated += int((out[:, 1:] != tokenizer.pad_token_id).sum())  # the start token is given, not generated
        hyps += tokenizer.batch_decode(out, skip_special_tokens=True)
        refs += list(batch["tgt_texts"])
    if not hyps:
        raise ValueError("nothing to score: the split holds no sentence pairs")
    return {
        **corpus_scores(hyps, refs),
        "loss": loss / max(tokens, 1),
        "sentences": len(hyps),
        "decoding": gen.describe(),
        "seconds": seconds,
        "sentences_per_s": len(hyps) / seconds,
        "tokens_per_s": generated / seconds,
        "peak_memory_mb": _peak_memory_mb(device),
        "examples": [{"reference": r, "hypothesis": h} for h, r in list(zip(hyps, refs))[: gen.log_examples]],
    }


def score_table(columns: dict[str, dict]) -> str:
    """Scores side by side: one column per model (or split)."""
    from gatedprune.utils import format_table

    rows = [
        ("BLEU", *(f"{c['bleu']:.2f}" for c in columns.values())),
        ("chrF", *(f"{c['chrf']:.2f}" for c in columns.values())),
        ("loss", *(f"{c['loss']:.3f}" for c in columns.values())),
        ("sentences", *(c["sentences"] for c in columns.values())),
        ("sentences/s", *(f"{c['sentences_per_s']:.1f}" for c in columns.values())),
        ("tokens/s", *(f"{c['tokens_per_s']:.0f}" for c in columns.values())),
    ]
    return format_table(["", *columns], rows)
