"""What ``gatedprune-export --format FMT`` converts: a model directory (an export, or any Hugging Face seq2seq
directory, pruned or dense), or a run (exported first, as ``--format hf`` would, then converted)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import transformers

log = logging.getLogger("gatedprune.export")


def is_model_dir(source: Path) -> bool:
    """A Hugging Face model directory (not a run: a run directory holds metrics.json)."""
    return (source / "config.json").is_file() and not (source / "metrics.json").exists()


def load_model_dir(source: Path):
    """``(model, tokenizer or None)``: a gatedprune export or any other seq2seq directory (``load_seq2seq``);
    float32, eval mode."""
    from gatedprune.surgery.model_loading import load_seq2seq

    model = load_seq2seq(source)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        tokenizer = None
        log.warning("no tokenizer in %s: verifying on random ids, and the export holds no tokenizer", source)
    return model.float().eval(), tokenizer


def convert_source(source: str | Path, out_dir: str | Path, fmt: str, *, val_pairs=None, samples: int = 8,
                   overwrite: bool = False, max_new_tokens: int = 20, rule: str = "binary", top_k=None,
                   device: str | None = "cpu", **options) -> dict:
    """``fmt`` of a model directory, or of a run (its verified export written to a hidden folder beside
    ``out_dir`` first, then removed)."""
    from gatedprune.deploy.formats import check, convert
    from gatedprune.shipping.export import export_checkpoint
    from gatedprune.shipping.export_dir import check_out_dir, check_target
    from gatedprune.shipping.export_inputs import check_counts, find_run_files, read_pairs, sample_batch

    source, out_dir = Path(source), Path(out_dir)
    check_counts(samples, max_new_tokens)
    if not source.exists():
        raise FileNotFoundError(f"no run directory, checkpoint or model directory at {source}")
    check_target(out_dir, overwrite)
    if not is_model_dir(source):
        checkpoint, run_dir = find_run_files(source)
        check_out_dir(out_dir, protected=[checkpoint, *([run_dir] if run_dir else [])], run_dir=run_dir)
        hidden = out_dir.parent / f".{out_dir.name}.hf-{os.getpid()}"  # this process's own
        try:
            export_checkpoint(source, hidden, rule=rule, top_k=top_k, samples=samples, val_pairs=val_pairs,
                              max_new_tokens=max_new_tokens, device=device)
            if val_pairs is None and run_dir is not None and (run_dir / "val_pairs.jsonl").is_file():
                val_pairs = run_dir / "val_pairs.jsonl"
            return convert_source(hidden, out_dir, fmt, val_pairs=val_pairs, samples=samples, overwrite=overwrite,
                                  max_new_tokens=max_new_tokens, **options)
        finally:
            shutil.rmtree(hidden, ignore_errors=True)
    if top_k is not None:
        raise ValueError(f"--top-k {top_k} with a model directory ({source}): its plan is already cut; allowed: "
                         f"--top-k with a run or checkpoint")
    check_out_dir(out_dir, protected=[source])
    model, tokenizer = load_model_dir(source)
    check(model, fmt, **options)  # refused before the verification batch is even built
    pairs = read_pairs(Path(val_pairs), samples) if val_pairs is not None and tokenizer is not None else None
    batch = sample_batch(model, tokenizer, pairs)
    return convert(model, out_dir, fmt, tokenizer=tokenizer, batch=batch, overwrite=overwrite,
                   max_new_tokens=max_new_tokens, **options)
