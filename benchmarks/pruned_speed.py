"""Inference speed of physically pruned models against the dense model they come from.

The model is the default one (conf/model/scratch_mbart.yaml, 8,000-token vocabulary), randomly initialised: speed
depends on shapes, not on weights. Each budget keeps the given number of heads per attention kind (the head counts
the lambda sweep in docs/lambda_sweep.md ended with), spread evenly over the layers. Dense and pruned models are
timed alternately in one process, so the ratios compare like with like on a noisy machine.

    .venv/bin/python benchmarks/pruned_speed.py [--threads 2] [--repeats 15] [--out docs/benchmarks/pruned_speed.md]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf

from gatedprune.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.surgery import count_parameters, prune_heads
from gatedprune.utils import atomic_write_text, format_table, markdown_table

ROOT = Path(__file__).resolve().parents[1]
# heads kept per kind (encoder, decoder, cross), of 24 each: the lambda sweep's results, dense first
BUDGETS = [(24, 24, 24), (2, 22, 24), (0, 14, 20), (0, 4, 12), (0, 0, 2)]


def default_model(vocab_size: int = 8000) -> transformers.PreTrainedModel:
    fields = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/scratch_mbart.yaml").from_scratch)
    config = transformers.AutoConfig.for_model(
        fields.pop("model_type"), vocab_size=vocab_size, decoder_start_token_id=2, forced_eos_token_id=None, **fields
    )
    return transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa").eval()


def even_plan(model: torch.nn.Module, kept_per_kind: dict[str, int]) -> dict[str, list[int]]:
    """Keep ``kept_per_kind[kind]`` heads of each kind, spread over its layers as evenly as possible."""
    plan = {}
    for kind in ATTENTION_KINDS:
        sites = [s for s in attention_sites(model) if s.kind == kind]
        total = kept_per_kind[kind]
        for layer, site in enumerate(sites):
            plan[site.path] = list(range(total // len(sites) + (layer < total % len(sites))))
    return plan


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


@torch.no_grad()
def measure(dense, pruned, batch: int, length: int, new_tokens: int, repeats: int) -> dict[str, tuple]:
    """Median milliseconds of the dense and the pruned model, timed alternately: a teacher-forced forward pass
    (scoring) and greedy generation of exactly ``new_tokens`` tokens with the KV cache."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, dense.config.vocab_size, (batch, length), generator=g)
    tgt = torch.randint(3, dense.config.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(src)
    jobs = {
        "forward": lambda m: m(input_ids=src, attention_mask=mask, decoder_input_ids=tgt),
        "generate": lambda m: m.generate(
            input_ids=src, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, num_beams=1,
        ),
    }
    result = {}
    for name, job in jobs.items():
        job(dense), job(pruned)  # warm-up
        times = {"dense": [], "pruned": []}
        for _ in range(repeats):
            times["dense"].append(_ms(lambda: job(dense)))
            times["pruned"].append(_ms(lambda: job(pruned)))
        result[name] = (statistics.median(times["dense"]), statistics.median(times["pruned"]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32, help="sentences per batch")
    parser.add_argument("--length", type=int, default=32, help="source and target tokens per sentence")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sentence")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/pruned_speed.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    dense = default_model()
    rows = []
    for budget in BUDGETS:
        pruned = prune_heads(copy.deepcopy(dense), even_plan(dense, dict(zip(ATTENTION_KINDS, budget))))
        ms = measure(dense, pruned, args.batch, args.length, args.new_tokens, args.repeats)
        params = count_parameters(pruned)
        rows.append((
            "/".join(map(str, budget)), sum(budget), f"{params:,}", f"{params / count_parameters(dense):.3f}",
            *(cell for dense_ms, pruned_ms in (ms["forward"], ms["generate"])
              for cell in (f"{dense_ms:.1f}", f"{pruned_ms:.1f}", f"{pruned_ms / dense_ms:.3f}")),
        ))
        print(f"measured {sum(budget)} heads", file=sys.stderr)
    header = ["heads enc/dec/cross", "heads", "params", "params ratio", "forward dense ms", "forward pruned ms",
              "forward ratio", "generate dense ms", "generate pruned ms", "generate ratio"]
    table = format_table(header, rows)
    print(table)
    setup = (
        f"batch {args.batch} x {args.length} tokens; greedy generation of {args.new_tokens} tokens; "
        f"{args.threads} threads; median of {args.repeats} alternating repeats; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {platform.processor() or platform.machine()}"
    )
    command = " ".join(["benchmarks/pruned_speed.py", *(sys.argv[1:] if argv is None else argv)])
    atomic_write_text(args.out, f"# Pruned model speed\n\n`{command}`\n\n{setup}\n\n{markdown_table(header, rows)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
