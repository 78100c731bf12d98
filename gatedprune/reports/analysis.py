"""Head report: what every attention head of a model does, and how much the model needs it.

    python -m gatedprune.analyze <run dir | model dir> [--split validation] [--max-pairs 200] [--out DIR] [data overrides]

A run directory is analysed as its last checkpoint holds it (gates in the run's ``pruning.eval_gate_mode``), a model
directory (an export, or any Hugging Face seq2seq model) as it loads; the data is the run's (``evaluate.train_config``),
the first ``--max-pairs`` pairs of the split, teacher-forced. Writes into ``--out`` (default ``<dir>/analysis``):
``heads.csv`` and ``heads.md`` (one row per head, the columns of ``COLUMNS``) and ``heatmap_<column>.png`` (layer x
head, a panel per attention kind). Attention weights need the eager implementation: the loaded model is switched to
it for the analysis only; training is untouched.

An export may have lost FFN units and whole layers too: its layers are renumbered (the record's ``kept_layers`` maps
a stack's layer now to its original one). Heads are reported by their original layer, the heads of a dropped layer
are absent (a grey row in the heatmaps), and ``heads.md`` says what else was removed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from gatedprune.structures.adapters import AttentionSite, attention_sites
from gatedprune.structures.kinds import ATTENTION_KINDS, FFN_KINDS, KINDS, STACKS
from gatedprune.errors import RunFailed
from gatedprune.data import SPLITS, collate_pairs
from gatedprune.reports.scoring import cross_entropy, teacher_forced_inputs
from gatedprune.reports.evaluate import run_of, split_data, train_config
from gatedprune.structures.masking import masked_heads
from gatedprune.surgery.cut import plan_record
from gatedprune.surgery.record import current_record

COLUMNS = {
    "path": "the attention module (its name in named_modules: the key of gates and plans)",
    "kind": "encoder (self-attention), decoder (self-attention) or cross (decoder-encoder attention)",
    "layer": "the layer in its stack, numbered as in the unpruned model (an export whose layers were dropped keeps "
             "the original numbers; path names the module as it is now)",
    "head": "the head's number in the unpruned model (an export keeps its original numbering)",
    "log_alpha": "the hard-concrete gate's log_alpha in the run's last checkpoint; empty for a model directory",
    "p_open": "P(gate != 0) = sigmoid(log_alpha - beta log(-gamma/zeta)); empty for a model directory",
    "importance": "Michel et al. 2019: |dL/d head mask| averaged over tokens, divided by the L2 norm of its module's "
                  "scores (gatedprune.methods.importance.head_importance)",
    "ablation": "teacher-forced token-mean cross-entropy with this head alone removed, minus that of the model as "
                "it is (nats per target token; > 0: the model needs the head)",
    "confidence": "mean over query tokens of the head's largest attention weight (Voita et al. 2019), in [0, 1]",
    "entropy": "mean over query tokens of the entropy of the head's attention weights (nats; <= log keys)",
    "to_prev": "fraction of query tokens whose largest attention weight is on the previous token (self-attention; "
               "empty for cross)",
    "to_same": "the same for the token itself",
    "to_next": "the same for the next token (0 for the decoder: it cannot look ahead)",
    "to_rarest": "encoder: fraction of query tokens whose largest weight is on the sentence's rarest token (fewest "
                 "occurrences on the training split's source side; ties: any of them; special tokens are no "
                 "candidates); empty elsewhere, or without a training split",
    "rarest_chance": "to_rarest of a head that attended uniformly: mean over the same query tokens of rarest "
                     "tokens / tokens of the sentence",
}
QUERY_TOKENS = ("Query tokens: the non-padding positions of the sentence the head reads from (the source for "
                "encoder heads, the decoder input for decoder and cross heads), EOS positions left out (so the "
                "mBART-style decoder start, which is EOS, is too).")
MEASURES = ("confidence", "entropy", "to_prev", "to_same", "to_next", "to_rarest", "rarest_chance")
POSITIONS = {"to_prev": -1, "to_same": 0, "to_next": 1}  # key position minus query position
ATTENTIONS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}
DEFAULT_MAX_PAIRS = 200


@dataclass
class Subject:
    """What is analysed: the model (gates attached for a run), where its tokenizer and data come from."""

    model: nn.Module
    path: Path  # the directory analysed
    tokenizer_path: Path
    gates: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # path -> (log_alpha, p_open)
    description: str = ""

    @property
    def name(self) -> str:
        """A short name for figure titles: the directory's, with its run's where it lies in one (``run/pruned``)."""
        inside = (self.path.parent / ".hydra").is_dir()
        return "/".join(self.path.resolve().parts[-2:]) if inside else self.path.resolve().name


def load_subject(path: Path, cfg) -> Subject:
    """A run directory's last checkpoint (gates in the run's evaluation mode) or a model directory."""
    from gatedprune.training.checkpoints import load_gated_checkpoint
    from gatedprune.surgery.model_loading import load_seq2seq

    checkpoint = path / "checkpoints" / "last.ckpt"
    if checkpoint.is_file():
        model, gates = load_gated_checkpoint(checkpoint)
        mode = str(cfg.pruning.get("eval_gate_mode", "binary")) if "pruning" in cfg else "binary"
        gates.set_mode(mode)
        values = {p: (g.log_alpha.detach().tolist(), g.p_open().detach().tolist()) for p, g in zip(gates.paths, gates.gates)}
        tokenizer = path / "tokenizer"
        if not tokenizer.is_dir():
            raise ValueError(f"{path} has a checkpoint but no tokenizer/ beside it: not a gatedprune run directory")
        return Subject(model, path, tokenizer, values, f"run {path} ({checkpoint.name}, gates in mode {mode!r})")
    if (path / "config.json").is_file():
        return Subject(load_seq2seq(path), path, path, {}, f"model directory {path}")
    raise _not_analysable(path)


def _not_analysable(path: Path) -> ValueError:
    return ValueError(f"{path} is neither a gated run directory (checkpoints/last.ckpt) nor a model directory "
                      "(config.json); give a run, or a model directory such as <run>/pruned")


def use_eager_attention(model: nn.Module) -> None:
    """Switch ``model`` to eager attention, the implementation that returns attention weights."""
    model.set_attn_implementation("eager")
    if model.config._attn_implementation != "eager":
        raise ValueError(f"{type(model).__name__} cannot switch to eager attention, which attention weights need")


def analysis_batches(data, split: str, max_pairs: int) -> list[dict]:
    """The first ``max_pairs`` pairs of ``split``, by source length into batches of the data's ``eval_batch_size``."""
    dataset = data.datasets[split]
    chosen = sorted(range(min(len(dataset), max_pairs)), key=lambda i: len(dataset.src_ids[i]))
    size = data.eval_batch_size
    return [collate_pairs([dataset[i] for i in chosen[at : at + size]], data.tokenizer.pad_token_id, with_texts=False)
            for at in range(0, len(chosen), size)]


def source_counts(data, vocab: int) -> torch.Tensor | None:
    """How often each token id occurs on the source side of the training split; None without one.  # (V,)"""
    if "train" not in data.datasets:
        return None
    ids = torch.tensor([i for ids in data.datasets["train"].src_ids for i in ids], dtype=torch.long)
    return torch.bincount(ids, minlength=vocab)


def heads_of(model: nn.Module, sites: list[AttentionSite]) -> dict[str, list[tuple[int, int]]]:
    """``{path: [(index in the module now, head number in the unpruned model), ...]}`` of every real head (grouped
    query attention's zero-output fillers left out)."""
    record = plan_record(model)
    if record is None:
        return {s.path: [(i, i) for i in range(s.num_heads)] for s in sites}
    from gatedprune.surgery.pruned_modeling import upgrade_record

    record = upgrade_record(record)
    out = {}
    for site in sites:
        kept = set(record["kept_heads"][site.kind][site.path])
        out[site.path] = [(i, head) for i, head in enumerate(record["slots"][site.path]) if head in kept]
    return out


def original_heads(model: nn.Module, site: AttentionSite) -> int:
    """How many query heads ``site`` had before any pruning."""
    record = plan_record(model)
    return record["num_heads"][site.path] if record is not None else site.num_heads


def _attention_of(output, site: AttentionSite) -> torch.Tensor:
    """The attention weights of ``site`` in a forward ``output``.  # (B, H, Q, K)"""
    per_layer = getattr(output, ATTENTIONS[site.kind])
    if per_layer is None or len(per_layer) <= site.layer:
        raise RunFailed(f"the model returned no {ATTENTIONS[site.kind]} for layer {site.layer} ({site.path})")
    weights = per_layer[site.layer]
    # a module left without heads computes with one phantom head (pruned_modeling.PhantomHead): none of its own
    if weights.shape[1] < site.num_heads:
        raise RunFailed(f"{site.path} has {site.num_heads} heads but returned attention for {weights.shape[1]}")
    return weights[:, : site.num_heads].float()


@torch.no_grad()
def attention_measures(model: nn.Module, batches: Sequence[dict], sites: list[AttentionSite], eos_id: int | None,
                       special_ids: Sequence[int] = (), counts: torch.Tensor | None = None,
                       progress: bool | None = None) -> dict[str, dict[str, torch.Tensor | None]]:
    """``{path: {measure: (H,) or None}}`` for the measures of ``MEASURES`` (see ``COLUMNS``, ``QUERY_TOKENS``).

    ``counts``: training-split source counts per token id, for the rare-token measure (None: left out).
    """
    sums = {s.path: {m: torch.zeros(s.num_heads) for m in MEASURES} for s in sites}
    queries = {s.path: 0.0 for s in sites}
    rare_queries = {s.path: 0.0 for s in sites}
    model.eval()
    for batch in tqdm(batches, desc="attention", unit="batch", disable=None if progress is None else not progress):
        inputs = teacher_forced_inputs(model, batch)
        output = model(**inputs, output_attentions=True)
        source, labels = batch["input_ids"], batch["labels"]  # (B, S), (B, T)
        decoder_ids = inputs.get("decoder_input_ids")
        if decoder_ids is None:  # the model shifts the labels right itself: position t reads label t - 1
            start = torch.full_like(labels[:, :1], model.config.decoder_start_token_id)
            decoder_ids = torch.cat([start, labels[:, :-1]], dim=1)
        not_eos = (lambda ids: ids != eos_id) if eos_id is not None else (lambda ids: torch.ones_like(ids, dtype=torch.bool))
        source_queries = batch["attention_mask"].bool() & not_eos(source)  # (B, S)
        target_queries = (labels != -100) & not_eos(decoder_ids)  # (B, T)
        rare = _rarest(source, batch["attention_mask"].bool(), special_ids, counts) if counts is not None else None
        for site in sites:
            weights = _attention_of(output, site)  # (B, H, Q, K)
            q = (source_queries if site.kind == "encoder" else target_queries).float()  # (B, Q)
            top, where = weights.max(dim=-1)  # (B, H, Q)
            entropy = -torch.special.xlogy(weights, weights).sum(dim=-1)  # (B, H, Q)
            acc = sums[site.path]
            acc["confidence"] += (top * q[:, None]).sum(dim=(0, 2))
            acc["entropy"] += (entropy * q[:, None]).sum(dim=(0, 2))
            queries[site.path] += float(q.sum())
            if site.kind != "cross":
                offset = where - torch.arange(where.shape[-1])  # (B, H, Q): key position - query position
                for name, step in POSITIONS.items():
                    acc[name] += ((offset == step).float() * q[:, None]).sum(dim=(0, 2))
            if site.kind == "encoder" and rare is not None:
                rarest, chance, has = rare  # (B, K) bool, (B,), (B,) bool
                qr = q * has[:, None]  # (B, Q): sentences with a candidate token
                hit = torch.gather(rarest[:, None, :].expand(-1, weights.shape[1], -1), 2, where)  # (B, H, Q)
                acc["to_rarest"] += (hit.float() * qr[:, None]).sum(dim=(0, 2))
                acc["rarest_chance"] += float((chance[:, None] * qr).sum())
                rare_queries[site.path] += float(qr.sum())
    out = {}
    for site in sites:
        acc, n, nr = sums[site.path], queries[site.path], rare_queries[site.path]
        out[site.path] = {
            "confidence": acc["confidence"] / n if n else None,
            "entropy": acc["entropy"] / n if n else None,
            **{name: acc[name] / n if n and site.kind != "cross" else None for name in POSITIONS},
            "to_rarest": acc["to_rarest"] / nr if nr else None,
            "rarest_chance": acc["rarest_chance"] / nr if nr else None,
        }
    return out


def _rarest(source: torch.Tensor, mask: torch.Tensor, special_ids: Sequence[int], counts: torch.Tensor):
    """Per sentence: which positions hold its rarest token, uniform attention's chance of hitting one, and whether
    it has a candidate at all.  source, mask: (B, S)"""
    candidate = mask & ~torch.isin(source, torch.tensor(list(special_ids), dtype=source.dtype))  # (B, S)
    known = source.clamp(max=len(counts) - 1)
    frequency = torch.where(source < len(counts), counts[known], 0).double()  # unseen ids: 0 occurrences
    frequency = frequency.masked_fill(~candidate, math.inf)
    rarest = candidate & (frequency == frequency.min(dim=-1, keepdim=True).values)  # (B, S)
    chance = rarest.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
    return rarest, chance.float(), candidate.any(dim=-1)


def _loss(model: nn.Module, batches: Sequence[dict], encoded: Sequence | None = None) -> float:
    """Teacher-forced cross-entropy per target token over all ``batches`` (``encoded``: their encoder outputs, which
    the decoder then reads instead of running the encoder again)."""
    total, tokens = 0.0, 0
    for i, batch in enumerate(batches):
        inputs = teacher_forced_inputs(model, batch)
        if encoded is not None:
            inputs["encoder_outputs"] = encoded[i]
        total += float(cross_entropy(model(**inputs).logits, batch["labels"], reduction="sum"))
        tokens += int((batch["labels"] != -100).sum())
    return total / max(tokens, 1)


@torch.no_grad()
def ablation_effects(model: nn.Module, batches: Sequence[dict], heads: dict[str, list[int]],
                     progress: bool | None = None) -> tuple[float, dict[str, dict[int, float]]]:
    """The loss of ``model`` as it is, and for each head of ``heads`` (``{path: indices in the module now}``) the
    loss with that head alone removed minus it (``masked_heads``: its slice of the output projection's input
    zeroed, what ``prune_heads`` computes)."""
    model.eval()
    sites = attention_sites(model)
    everything = {site.path: list(range(site.num_heads)) for site in sites}
    kinds = {site.path: site.kind for site in sites}
    effects: dict[str, dict[int, float]] = {path: {} for path in heads}
    with masked_heads(model, everything) as mask:
        base = _loss(model, batches)
        # removing a decoder or cross-attention head leaves the encoder's output as it is: encode once
        encoder = model.get_encoder()
        encoded = [encoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]) for b in batches]
        todo = [(path, i) for path, indices in heads.items() for i in indices]
        for path, i in tqdm(todo, desc="ablation", unit="head", disable=None if progress is None else not progress):
            mask.fix_({path: [h for h in everything[path] if h != i]})
            effects[path][i] = _loss(model, batches, None if kinds[path] == "encoder" else encoded) - base
            mask.fix_({path: everything[path]})
    return base, effects


@dataclass
class Report:
    rows: list[dict]  # one per head: the columns of COLUMNS
    # (path, kind, original layer, heads before pruning) of every attention module, by kind and layer; path None for
    # one whose layer was dropped (it has no heads left)
    modules: list[tuple[str | None, str, int, int]]
    about: dict  # what was analysed, on which data, and the model's loss there


def original_layers(model: nn.Module) -> dict[str, list[int]]:
    """``{stack: the original index of each layer present}`` (the identity for a model whose layers all remain)."""
    return current_record(model)["kept_layers"]


def structures_removed(model: nn.Module) -> dict:
    """What the model lost beside heads: ``{"layers": {stack: (dropped original indices, layers before)},
    "units": {kind: (kept, before)}}``, the units of a dropped layer counted as removed."""
    record = current_record(model)
    dropped = [entry for entries in record["dropped"].values() for entry in entries]
    layers = {stack: (sorted(set(range(n)) - set(record["kept_layers"].get(stack, range(n)))), n)
              for stack in STACKS if stack in record["num_layers"] for n in [record["num_layers"][stack]]}
    units = {kind: (sum(len(kept) for kept in per_path.values()),
                    sum(record["num_units"][p] for p in per_path) + sum(e["units"].get(kind, 0) for e in dropped))
             for kind in FFN_KINDS if kind in record["kept_units"] for per_path in [record["kept_units"][kind]]}
    return {"layers": layers, "units": units}


def report_modules(model: nn.Module, sites: list[AttentionSite]) -> list[tuple[str | None, str, int, int]]:
    """``Report.modules``: the attention modules present at their original layers, and the heads every dropped layer
    had (no path), by kind and original layer."""
    record, layers = current_record(model), original_layers(model)
    modules = [(s.path, s.kind, layers[KINDS[s.kind].stack][s.layer], original_heads(model, s)) for s in sites]
    for stack, entries in record["dropped"].items():
        modules += [(None, kind, entry["layer"], heads) for entry in entries for kind, heads in entry["heads"].items()]
    return sorted(modules, key=lambda m: (ATTENTION_KINDS.index(m[1]), m[2]))


def analyze(path: str | Path, split: str = "validation", max_pairs: int = DEFAULT_MAX_PAIRS,
            overrides: Sequence[str] = (), progress: bool | None = None) -> Report:
    """Every measure of every head of the run or model at ``path`` (see the module docstring); writes nothing."""
    from gatedprune.methods.importance import head_importance

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (give a run directory or a model directory)")
    if not isinstance(max_pairs, int) or max_pairs < 1:
        raise ValueError(f"--max-pairs {max_pairs}; allowed: an integer >= 1")
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}; allowed: {', '.join(SPLITS)}")
    if not any((path / p).is_file() for p in ("checkpoints/last.ckpt", "config.json")):
        raise _not_analysable(path)
    if run_of(path) is None and not overrides:  # the trainer's default data would be a guess, never said
        raise ValueError(f"{path} lies outside any run, so its data is not recorded; allowed: the data to analyse on "
                         "as overrides, e.g. data=files data.files.validation=dev.tsv (data.files.train=train.tsv "
                         "for to_rarest), or data=bible for the built-in Bible pairs")
    cfg = train_config(path, overrides)
    subject = load_subject(path, cfg)
    model = subject.model
    if not any(heads_of(model, attention_sites(model)).values()):  # a report's rows are heads: it would have none
        raise ValueError(f"{path} has no attention heads left (every one was pruned): nothing to analyse; allowed: "
                         "a model with at least one head (gatedprune-evaluate scores this one)")
    data = split_data(cfg, subject.tokenizer_path, split, model)  # over-long pairs cut to its positions
    tokenizer = data.tokenizer
    use_eager_attention(model)
    batches = analysis_batches(data, split, max_pairs)
    sites = attention_sites(model)
    heads = heads_of(model, sites)
    counts = source_counts(data, max(len(tokenizer), int(model.config.vocab_size)))
    measures = attention_measures(model, batches, sites, tokenizer.eos_token_id, tokenizer.all_special_ids, counts,
                                  progress)
    importance = head_importance(model, batches, progress=sys.stderr.isatty() if progress is None else progress)
    base, ablation = ablation_effects(model, batches, {p: [i for i, _ in hs] for p, hs in heads.items()}, progress)
    rows, layers = [], original_layers(model)
    for site in sites:
        log_alpha, p_open = subject.gates.get(site.path, (None, None))
        scores = importance.get(site.path)
        for index, head in heads[site.path]:
            row = {"path": site.path, "kind": site.kind, "layer": layers[KINDS[site.kind].stack][site.layer], "head": head,
                   "log_alpha": log_alpha[index] if log_alpha else None, "p_open": p_open[index] if p_open else None,
                   "importance": float(scores[index]) if scores is not None and len(scores) > index else None,
                   "ablation": ablation[site.path][index]}
            row.update({m: None if v is None else float(v[index]) for m, v in measures[site.path].items()})
            rows.append(row)
    about = {
        "subject": subject.description, "name": subject.name, "split": split, "pairs": sum(len(b["input_ids"]) for b in batches),
        "data": data.describe()["source"], "loss": base, "train_counts": counts is not None,
        "target_tokens": sum(int((b["labels"] != -100).sum()) for b in batches), "removed": structures_removed(model),
    }
    return Report(rows, report_modules(model, sites), about)


if __name__ == "__main__":
    from gatedprune.cli import analyze_command

    sys.exit(analyze_command())
