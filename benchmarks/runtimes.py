"""Greedy decoding speed of dense and pruned models in each runtime they ship to: transformers' generate(),
CTranslate2 float32 and int8, ONNX Runtime (gatedprune.deploy), all timed alternately in one process.

Models: the default model's dense checkpoint and exports of the lambda sweep with every kind gated
(docs/lambda_sweep_kinds.md), with their validation BLEU measured here on the same pairs in each runtime; and
Transformer-base shapes (a random Marian, d 512, 6+6 layers, 8 heads, FFN 2048, 32k vocabulary) cut by the plans
of the structures issue; with --untrained, an untrained model of the dense checkpoint's shapes beside it (does a
fixed number of tokens take the same time whatever the weights?). Each runtime decodes exactly --new-tokens tokens
per sentence (EOS held off), at batch 1 (--sentences sources, one at a time) and batch 32; with one thread and with
every core.

    .venv/bin/python benchmarks/runtimes.py --dense RUN/checkpoints/dense.ckpt --exports A/1 A/2 [--out docs/benchmarks/runtimes.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, command_line, machine, marian_base, versions  # noqa: E402

from gatedprune import load_pruned  # noqa: E402
from gatedprune.deploy import ct2  # noqa: E402
from gatedprune.deploy.formats import convert  # noqa: E402
from gatedprune.shipping.export_inputs import sample_batch  # noqa: E402
from gatedprune.structures.adapters import probe  # noqa: E402
from gatedprune.structures.sites import structure_sites  # noqa: E402
from gatedprune.surgery.cut import count_parameters, prune_heads  # noqa: E402
from gatedprune.training.checkpoints import load_gated_checkpoint  # noqa: E402
from gatedprune.utils import atomic_write_text, markdown_table  # noqa: E402

RUNTIMES = ("transformers", "ct2 float32", "ct2 int8", "onnx")


class Variant:
    """One model, converted to every runtime; ``run(runtime, batches, threads, new_tokens)`` decodes ``batches``."""

    def __init__(self, name: str, model, tokenizer, workdir: Path, note: str = "", onnx: bool = True):
        self.name, self.model, self.tokenizer, self.note = name, model.float().eval(), tokenizer, note
        self.tokens = ct2.vocabulary(model, tokenizer)
        batch = sample_batch(model)
        self.ct2_dir = workdir / f"{name}-ct2"
        convert(model, self.ct2_dir, "ct2", tokenizer=tokenizer, batch=batch, max_new_tokens=8)
        self.onnx = None
        try:
            if not onnx:
                raise ImportError("not asked for")
            from gatedprune.deploy.onnx_greedy import OnnxSeq2Seq

            convert(model, workdir / f"{name}-onnx", "onnx", tokenizer=tokenizer, batch=batch, max_new_tokens=8)
            self.onnx = (OnnxSeq2Seq, workdir / f"{name}-onnx")
        except ImportError as err:  # the ONNX format not there: its column stays empty
            print(f"onnx: {err}", file=sys.stderr)
        self.translators: dict = {}
        self.sessions: dict = {}
        self.params = count_parameters(model)

    def translator(self, compute_type: str, threads: int):
        key = (compute_type, threads)
        if key not in self.translators:
            import ctranslate2

            self.translators[key] = ctranslate2.Translator(str(self.ct2_dir), device="cpu", compute_type=compute_type,
                                                           inter_threads=1, intra_threads=threads)
        return self.translators[key]

    def session(self, threads: int):
        if threads not in self.sessions:
            cls, directory = self.onnx
            self.sessions[threads] = cls(directory, threads=threads)
        return self.sessions[threads]

    def run(self, runtime: str, batches: list[list[list[int]]], threads: int, new_tokens: int) -> list:
        out = []
        for sources in batches:
            if runtime == "transformers":
                out += self._generate(sources, new_tokens, min_new=new_tokens)
            elif runtime.startswith("ct2"):
                translator = self.translator(runtime.split()[1], threads)
                results = translator.translate_batch([[self.tokens[i] for i in s] for s in sources], beam_size=1,
                                                     max_decoding_length=new_tokens, min_decoding_length=new_tokens)
                index = {t: i for i, t in enumerate(self.tokens)}
                out += [[index[t] for t in r.hypotheses[0]] for r in results]
            else:  # every row decodes new_tokens steps (EOS does not stop it), as min_new_tokens does elsewhere
                import numpy as np

                width, pad = max(map(len, sources)), self.model.config.pad_token_id
                ids = np.array([s + [pad] * (width - len(s)) for s in sources])  # (B, S)
                mask = np.array([[1] * len(s) + [0] * (width - len(s)) for s in sources])
                out += self.session(threads).generate(ids, mask, new_tokens, stop_at_eos=False).tolist()
        return out

    @torch.no_grad()
    def _generate(self, sources: list[list[int]], new_tokens: int, min_new: int = 0) -> list[list[int]]:
        pad = self.model.config.pad_token_id
        width = max(map(len, sources))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in sources])  # (B, S)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sources])
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=min_new,
                                  do_sample=False, num_beams=1, forced_eos_token_id=None)
        return [row[1:].tolist() for row in out]


def timed(variants: list[Variant], runtimes: list[str], batches, threads: int, new_tokens: int, repeats: int) -> dict:
    """Median seconds of each (variant, runtime), all timed in turn."""
    torch.set_num_threads(threads)
    jobs = [(v, r) for v in variants for r in runtimes if r != "onnx" or v.onnx]
    times = alternate(lambda job: job[0].run(job[1], batches, threads, new_tokens), jobs, repeats)
    return {(v.name, r): t for (v, r), t in zip(jobs, times)}


def bleu_in_runtimes(variant: Variant, pairs: list[dict], new_tokens: int) -> dict:
    """Validation BLEU of greedy translations (up to EOS) of ``pairs`` in each runtime, the same sentences."""
    import sacrebleu

    tok = variant.tokenizer
    sources = [tok(p["source"])["input_ids"] for p in pairs]
    eos = variant.model.config.eos_token_id
    refs = [[p["target"] for p in pairs]]
    scores = {}
    for runtime in ("transformers", "ct2 float32", "ct2 int8"):
        if runtime == "transformers":
            hyps = variant._generate(sources, new_tokens)
        else:
            results = variant.translator(runtime.split()[1], 1).translate_batch(
                [[variant.tokens[i] for i in s] for s in sources], beam_size=1, max_decoding_length=new_tokens,
                min_decoding_length=0)
            index = {t: i for i, t in enumerate(variant.tokens)}
            hyps = [[index[t] for t in r.hypotheses[0]] for r in results]
        text = [tok.decode([t for t in h if t != eos], skip_special_tokens=True) for h in hyps]
        scores[runtime] = sacrebleu.corpus_bleu(text, refs).score
    return scores


def base_variants(workdir: Path, onnx: bool) -> list[Variant]:
    """Transformer-base shapes, random weights: dense and the structures issue's plans."""
    torch.manual_seed(0)
    dense = marian_base()
    layers = probe(dense).layers
    ffn = structure_sites(dense, ["encoder_ffn", "decoder_ffn"])
    half_ffn = {s.path: list(range(s.num_units // 2)) for s in ffn}
    plans = {
        "FFN halved": half_ffn,
        "decoder 6->2 layers": {layers["decoder"]: [0, 5]},
        "decoder 1 layer + FFN halved": {**half_ffn, layers["decoder"]: [5]},
    }
    variants = [Variant("base dense", dense, None, workdir, onnx=onnx)]
    for name, plan in plans.items():
        model = marian_base()
        model.load_state_dict(dense.state_dict())
        prune_heads(model, plan)
        variants.append(Variant(f"base {name}", model, None, workdir, onnx=onnx))
    return variants


def default_variants(dense_ckpt: Path, exports: list[Path], workdir: Path, onnx: bool,
                     untrained: bool = False) -> tuple[list, list[dict]]:
    dense, gates = load_gated_checkpoint(dense_ckpt)
    gates.remove()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports[0])
    variants = [Variant("default dense", dense, tokenizer, workdir, note=f"{dense_ckpt}", onnx=onnx)]
    if untrained:  # do the weights change the time of a fixed number of tokens? (speed_quality's stand-in says not)
        torch.manual_seed(0)
        fresh = type(dense)(dense.config)
        variants.append(Variant("default dense, untrained", fresh, tokenizer, workdir,
                                note="the dense checkpoint's config, random weights (seed 0)", onnx=onnx))
    for export in exports:
        metrics = json.loads((export.parent / "metrics.json").read_text())
        lam = metrics.get("l0_lambda")
        name = f"default lambda {lam:g}" if isinstance(lam, (int, float)) else f"default {export.parent.name}"
        variants.append(Variant(name, load_pruned(export), tokenizer, workdir,
                                note=f"{export}, validation BLEU {metrics['bleu']:.2f} (metrics.json)", onnx=onnx))
    pairs = [json.loads(line) for line in (exports[0].parent / "val_pairs.jsonl").read_text().splitlines()]
    return variants, pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, help="the default model's dense checkpoint")
    parser.add_argument("--exports", type=Path, nargs="+", help="exports of the sweep (RUN/pruned)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=4, help="sources decoded one at a time (batch 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count()])
    parser.add_argument("--skip-base", action="store_true", help="leave out the Transformer-base shapes")
    parser.add_argument("--untrained", action="store_true",
                        help="time an untrained model of the dense checkpoint's shapes beside it")
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--render", action="store_true", help="rewrite --out from its .json, without a rerun")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(args.out.with_suffix(".json").read_text())
        atomic_write_text(args.out, render(results, results.get("new_tokens", args.new_tokens)))
        return 0
    if args.dense is None or not args.exports:
        parser.error("--dense and --exports are required (except with --render)")
    work = Path(tempfile.mkdtemp(prefix="runtimes-"))
    groups = {}
    onnx = "onnx" in args.runtimes
    default, pairs = default_variants(args.dense, args.exports, work, onnx, args.untrained)
    tok = default[0].tokenizer
    groups["default model (validation sources)"] = (default, [tok(p["source"])["input_ids"] for p in pairs])
    if not args.skip_base:
        generator = torch.Generator().manual_seed(0)
        sources = torch.randint(1, 31000, (32, 24), generator=generator).tolist()
        groups["Transformer-base shapes (random weights, 24-token sources)"] = (base_variants(work, onnx), sources)
    results = {"new_tokens": args.new_tokens,
               "command": command_line("runtimes.py", sys.argv[1:] if argv is None else argv), "machine": machine(),
               "versions": versions(), "groups": {}}
    for title, (variants, sources) in groups.items():
        group = {"variants": {v.name: {"params": v.params, "note": v.note} for v in variants}, "cells": []}
        for threads in args.threads:
            for batch_size in (1, 32):
                chosen = sources[: args.sentences] if batch_size == 1 else sources[:32]
                batches = [[s] for s in chosen] if batch_size == 1 else [chosen]
                times = timed(variants, args.runtimes, batches, threads, args.new_tokens, args.repeats)
                for (name, runtime), t in times.items():
                    group["cells"].append({"variant": name, "runtime": runtime, "threads": threads,
                                           "batch": batch_size, "sentences": len(chosen), "wall": t.wall,
                                           "cpu": t.cpu})
                print(f"{title}: threads {threads}, batch {batch_size} done", file=sys.stderr, flush=True)
        results["groups"][title] = group
    results["bleu"] = {v.name: bleu_in_runtimes(v, pairs, 64) for v in default}
    page = render(results, args.new_tokens)
    print(page)
    if args.out:
        atomic_write_text(args.out, page)
        atomic_write_text(args.out.with_suffix(".json"), json.dumps(results, indent=2) + "\n")
    return 0


def render(results: dict, new_tokens: int) -> str:
    results.setdefault("new_tokens", new_tokens)
    lines = [f"Measured with `{results['command']}` ({results['machine']}; {results['versions']}).", "",
             f"Greedy decoding of exactly {new_tokens} tokens per sentence. ms/sentence = wall time of the batch / "
             f"sentences; speed-up = dense `generate()` time / this time, same threads and batch, timed alternately "
             f"in one process (median of repeats). threads: torch's threads, CTranslate2's intra_threads, ONNX Runtime's "
             f"intra-op threads (the machine string names the torch setting the script started with). CPU only: no "
             f"GPU was lent to this issue.", ""]
    for title, group in results["groups"].items():
        lines += [f"## {title}", ""]
        for name, v in group["variants"].items():
            lines.append(f"- {name}: {v['params']:,} parameters{'; ' + v['note'] if v['note'] else ''}")
        lines.append("")
        cells = group["cells"]
        dense = next(iter(group["variants"]))
        header = ["model", "runtime", "threads", "b1 ms/sentence", "b1 tokens/s", "b1 speed-up", "b32 ms/sentence",
                  "b32 tokens/s", "b32 speed-up", "b1 CPU speed-up"]
        rows = []
        for cell in (c for c in cells if c["batch"] == 1):
            other = next(c for c in cells if c["batch"] == 32 and c["variant"] == cell["variant"]
                         and c["runtime"] == cell["runtime"] and c["threads"] == cell["threads"])
            base = {b: next(c for c in cells if c["batch"] == b and c["variant"] == dense
                            and c["runtime"] == "transformers" and c["threads"] == cell["threads"]) for b in (1, 32)}
            tokens = results["new_tokens"]
            rows.append([cell["variant"], cell["runtime"], cell["threads"],
                         f"{1000 * cell['wall'] / cell['sentences']:.1f}",
                         f"{tokens * cell['sentences'] / cell['wall']:.0f}", f"{base[1]['wall'] / cell['wall']:.2f}",
                         f"{1000 * other['wall'] / other['sentences']:.2f}",
                         f"{tokens * other['sentences'] / other['wall']:.0f}", f"{base[32]['wall'] / other['wall']:.2f}",
                         f"{base[1]['cpu'] / cell['cpu']:.2f}" if cell["threads"] == 1 else "-"])
        lines += [markdown_table(header, rows), ""]
    lines += ["## Validation BLEU in each runtime (the default model)", "",
              "Greedy, up to EOS (at most 64 tokens), on the 32 validation pairs the exports were verified on: the same "
              "sentences in each runtime.", ""]
    rows = [[name, *(f"{b[r]:.2f}" for r in ("transformers", "ct2 float32", "ct2 int8"))]
            for name, b in results["bleu"].items()]
    lines += [markdown_table(["model", "transformers", "ct2 float32", "ct2 int8"], rows), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
