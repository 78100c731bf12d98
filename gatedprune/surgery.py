"""Remove attention heads physically: any plan in, a smaller model out that saves and reloads.

A plan is ``{attention module path: kept head indices}``, the indices counted among the module's current heads;
modules it does not name keep all their heads. Gates (``HeadGates.plan()``), a baseline or a hand-written dict all
produce the same type; only ``prune_heads`` touches weights. The cutting itself lives in ``remote_modeling``,
which is also written beside exported weights, so both loading paths rebuild the same shapes.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import transformers
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING

from gatedprune.adapters import AttentionSite, adapter_for, attention_sites
from gatedprune.gating import HeadGates, attach_gates
from gatedprune.remote_modeling import CONFIG_KEY, install_runtime, prune_attention, pruned_model_class

RECORD_FORMAT = 1
# the fields of FamilyAdapter the runtime needs; they travel in the record so the saved directory describes itself
LAYOUT_FIELDS = ("q", "k", "v", "o", "num_heads_attr", "head_dim_attr", "inner_dim_attr", "position_bias_attr")

Plan = Mapping[str, Iterable[int]]


def _sites(model: nn.Module) -> dict[str, AttentionSite]:
    return {site.path: site for site in attention_sites(model)}


def check_plan(model: nn.Module, plan: Plan) -> dict[str, list[int]]:
    """Validate ``plan`` against ``model`` before anything is cut; returns it with sorted head lists.

    Raises ``ValueError`` naming every module that is not an attention module of the model and every head index
    that is not an integer in [0, heads), or is repeated.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"a plan is a mapping {{attention module path: kept head indices}}, got {type(plan).__name__}")
    sites = _sites(model)
    unknown = [path for path in plan if path not in sites]
    if unknown:
        examples = ", ".join(list(sites)[:3])
        raise ValueError(
            f"the plan names {len(unknown)} module(s) that are not attention modules of this "
            f"{model.config.model_type} model: {unknown[:5]}; its {len(sites)} attention modules are named like "
            f"{examples}"
        )
    problems, checked = [], {}
    for path, heads in plan.items():
        num_heads = sites[path].num_heads
        kept = []
        if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
            problems.append(f"{path}: kept heads must be a list of head indices, got {heads!r}")
            heads = ()
        for head in heads:
            try:
                if isinstance(head, bool):
                    raise TypeError
                head = operator.index(head)
            except TypeError:
                problems.append(f"{path}: head {head!r} is not an integer")
                continue
            if not 0 <= head < num_heads:
                problems.append(f"{path}: head {head} does not exist (the module has heads 0..{num_heads - 1})")
            elif head in kept:
                problems.append(f"{path}: head {head} is listed twice")
            else:
                kept.append(head)
        checked[path] = sorted(kept)
    if problems:
        raise ValueError("invalid head plan:\n  " + "\n  ".join(problems))
    return checked


def plan_record(model: nn.Module) -> dict | None:
    """The record ``prune_heads`` keeps on ``model.config`` (see ``remote_modeling``), or None if never pruned."""
    return getattr(model.config, CONFIG_KEY, None)


def _unpruned_record(model: nn.Module) -> dict:
    adapter = adapter_for(model)
    kept_heads: dict[str, dict[str, list[int]]] = {}
    for site in attention_sites(model):
        kept_heads.setdefault(site.kind, {})[site.path] = list(range(site.num_heads))
    return {
        "format": RECORD_FORMAT,
        "kept_heads": kept_heads,
        "num_heads": {path: len(kept) for per_kind in kept_heads.values() for path, kept in per_kind.items()},
        "layout": {field: getattr(adapter, field) for field in LAYOUT_FIELDS},
        "rule": None,
    }


def prune_heads(model: nn.Module, plan: Plan, rule: str | None = None) -> nn.Module:
    """Shrink ``model`` in place to the heads ``plan`` keeps and record the plan on ``model.config``.

    Removes the q/k/v rows and output-projection columns of every other head of the named attention modules
    (encoder self-, decoder self- and cross-attention of every supported family) and updates the head counts.
    The record on the config holds the kept heads in the original numbering, so pruning twice composes and
    ``model.save_pretrained(d)`` then ``load_pruned(d)`` round-trips. ``rule`` says how the plan was made.
    Prune a model without gates attached (``gates.remove()``): the gate hooks expect the old head count.
    """
    plan = check_plan(model, plan)
    sites = _sites(model)
    record = copy.deepcopy(plan_record(model)) or _unpruned_record(model)
    for path, kept in plan.items():
        site = sites[path]
        if len(kept) == site.num_heads:
            continue
        prune_attention(site.module, kept, record["layout"])
        before = record["kept_heads"][site.kind][path]
        record["kept_heads"][site.kind][path] = [before[head] for head in kept]
    if rule is not None:
        record["rule"] = rule
    setattr(model.config, CONFIG_KEY, record)
    install_runtime(model, record)
    return model


@contextmanager
def masked_heads(model: nn.Module, plan: Plan) -> Iterator[HeadGates]:
    """``model`` gated with every gate fixed by ``plan``: open for kept heads, closed for the others.

    This is the function ``prune_heads(model, plan)`` must compute; the gates go when the block ends.
    """
    plan = check_plan(model, plan)
    gates = attach_gates(model).fix_(plan).set_mode("binary")
    try:
        yield gates
    finally:
        gates.remove()


def head_parameters(site: AttentionSite) -> int:
    """Parameters one head of ``site`` owns: its q/k/v rows (and biases) and its output-projection columns."""
    total = site.projection("o").out_features * site.head_dim
    for name in ("q", "k", "v"):
        linear = site.projection(name)
        total += site.head_dim * (linear.in_features + (linear.bias is not None))
    return total


def removed_parameters(model: nn.Module, plan: Plan) -> int:
    """How many parameters ``prune_heads(model, plan)`` removes."""
    sites = _sites(model)
    return sum(
        head_parameters(sites[path]) * (sites[path].num_heads - len(kept))
        for path, kept in check_plan(model, plan).items()
    )


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())


def family_class(config: transformers.PretrainedConfig) -> type:
    """The transformers seq2seq LM class of ``config`` (e.g. ``MarianMTModel`` for a MarianConfig)."""
    return MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(config)]


def fresh_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """A newly initialised model of ``config``'s family, cut to the shapes of its plan if it has one."""
    base = family_class(config)
    model = pruned_model_class(base)(config)
    model.__class__ = base  # see load_pruned
    return model


def load_pruned(path: str | Path, **from_pretrained_kwargs) -> transformers.PreTrainedModel:
    """Load a model saved after ``prune_heads`` (by ``save_pretrained`` or the exporter) with its pruned shapes.

    Returns an instance of the family's own class (e.g. ``MarianMTModel``); keyword arguments go to
    ``from_pretrained`` (``dtype``, ``device_map``, ``attn_implementation``, ...).
    """
    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, CONFIG_KEY, None) is None:
        raise ValueError(
            f"{path} holds no head plan (its config has no {CONFIG_KEY!r} entry): it was not saved after "
            "gatedprune.prune_heads; load it with AutoModelForSeq2SeqLM.from_pretrained"
        )
    base = family_class(config)
    model = pruned_model_class(base).from_pretrained(path, config=config, **from_pretrained_kwargs)
    # the subclass only adds the shape restore to the constructor; once built, the model is an ordinary `base`
    model.__class__ = base
    return model
