"""Score a seq2seq model on a split: sacreBLEU BLEU and chrF, loss, the decoding used and how fast it ran.

The trainer scores validation, the dense model and the exported model with it; ``gatedprune-evaluate`` scores any
Hugging Face seq2seq directory, pruned by gatedprune or not, on a split of any data source the trainer accepts:

    gatedprune-evaluate MODEL_DIR [--split test] [--num-beams N] [--batch-size N] [data overrides ...]

e.g. ``gatedprune-evaluate outputs/<date>/<time>/pruned --num-beams 4`` (the Bible test split) or
``gatedprune-evaluate my-model data=files data.files.train=train.tsv data.files.validation=dev.tsv
data.files.test=test.tsv``. A model directory inside a run (its export, ``<run>/pruned``) is scored on the run's
data (``train_config``). It prints a table and writes ``eval.json`` (``--out``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

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


# --- gatedprune-evaluate ---------------------------------------------------------------------------------------


def load_seq2seq(model_dir: str | Path):
    """A pruned export (``load_pruned``) or any Hugging Face seq2seq model (directory or cached hub id);
    ``ValueError`` for anything else."""
    import transformers

    from gatedprune.pruned_modeling import CONFIG_KEY
    from gatedprune.surgery import load_pruned

    path = Path(model_dir)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")
    try:  # a local directory, or a hub id already in the cache (nothing is downloaded offline)
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except OSError:
        raise ValueError(f"{model_dir} is neither a model directory nor a cached hub model") from None
    if getattr(config, CONFIG_KEY, None) is not None:
        return load_pruned(model_dir)
    if type(config) not in transformers.AutoModelForSeq2SeqLM._model_mapping:
        raise ValueError(f"{model_dir} holds a {config.model_type!r} model, not a sequence-to-sequence one")
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(model_dir)


RUN_RECORD = ".hydra"  # where Hydra records a run's config (config.yaml) and its command line (overrides.yaml)


def run_of(path: str | Path) -> Path | None:
    """The run directory ``path`` is, or lies in (a gated run's export ``<run>/pruned``, a baseline's level export
    ``<run>/levels/<n>_heads/pruned``): the nearest of ``path`` and its ancestors that holds Hydra's record of a
    run's config; None for a directory outside any run."""
    path = Path(path)
    if not path.is_dir():
        return None
    return next((d for d in (path, *path.resolve().parents) if (d / RUN_RECORD / "config.yaml").is_file()), None)


def train_config(model_dir: str | Path, overrides: Sequence[str] = ()):
    """The trainer's config that names the data (and test decoding) for the model in ``model_dir``.

    A run directory, or a model directory inside one (its export), is scored on its run's data: the config the
    run recorded, or, with ``overrides``, the run's own command line (``.hydra/overrides.yaml``) followed by them.
    Any other model: the trainer's defaults with ``overrides``. Splits of ``data=files`` left unset are None.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from gatedprune.cli import one_line

    run = run_of(model_dir)
    if run is not None and not overrides:
        cfg = OmegaConf.load(run / RUN_RECORD / "config.yaml")
        # recorded as ${hydra:runtime.output_dir}, which only resolves inside a running Hydra app
        OmegaConf.update(cfg, "paths.output_dir", str(run), force_add=True)
    else:
        recorded = run / RUN_RECORD / "overrides.yaml" if run is not None else None
        before = [str(o) for o in OmegaConf.load(recorded)] if recorded is not None and recorded.is_file() else []
        try:
            with initialize_config_module("gatedprune.conf", version_base="1.3"):
                cfg = compose("train", overrides=[*before, *overrides, "paths.output_dir=."])
        except HydraException as err:  # a mistyped override: the trainer's one-line wording
            cause = f": {one_line(str(err.__cause__))}" if err.__cause__ is not None else ""
            raise ValueError(one_line(str(err)) + cause) from None
    files = cfg.data.get("files")
    for name in list(files or {}):  # data=files: the splits not given are not needed here
        if OmegaConf.is_missing(files, name):
            files[name] = None
    return cfg


def split_data(cfg, tokenizer_path: str | Path, split: str):
    """The data module of ``cfg.data``, set up with the tokenizer at ``tokenizer_path``; it must have ``split`` (the
    source's other splits come along where it has them)."""
    from hydra.utils import instantiate

    if split not in ("train", "validation", "test"):
        raise ValueError(f"--split {split!r}; allowed: train, validation, test")
    data = instantiate(cfg.data, tokenizer_path=str(tokenizer_path), required_splits=[split], _convert_="all")
    data.setup("test")
    if split not in data.datasets:
        raise ValueError(f"data source {data.source!r} has no {split!r} split; give one (e.g. data.files.{split}=...)")
    return data


def evaluate_dir(model_dir: str | Path, split: str = "test", overrides: Sequence[str] = (),
                 num_beams: int | None = None, batch_size: int | None = None) -> dict:
    """Score the model in ``model_dir`` on ``split`` of its data (``train_config``: its run's, or the trainer's
    defaults with ``overrides``).

    The model's own tokenizer (in ``model_dir``) tokenises the data; decoding is the trainer's test decoding
    (``test_generation``), with ``num_beams`` and ``batch_size`` if given.
    """
    from hydra.utils import instantiate

    cfg = train_config(model_dir, overrides)
    gen = instantiate(cfg.test_generation, _convert_="all")
    if num_beams is not None or batch_size is not None:
        gen = GenerationConfig(**{**asdict(gen), **({"num_beams": num_beams} if num_beams else {}),
                                  **({"batch_size": batch_size} if batch_size else {})})
    if split not in ("train", "validation", "test"):
        raise ValueError(f"--split {split!r}; allowed: train, validation, test")
    model = load_seq2seq(model_dir)
    data = split_data(cfg, model_dir, split)  # the model's own tokenizer
    result = score(model, data.tokenizer, data.loader(split, gen.batch_size, shard=False), gen)
    return {"model": str(model_dir), "split": split, "data": data.describe(), **result}
