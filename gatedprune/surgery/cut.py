"""Remove attention heads physically: any plan in, a smaller model out that saves and reloads.

A plan is ``{attention module path: kept head indices}``, the indices counted among the module's current heads;
modules it does not name keep all their heads. Gates (``HeadGates.plan()``), a baseline or a hand-written dict all
produce the same type; only ``prune_heads`` touches weights. The cutting itself lives in ``pruned_modeling``,
which is also written beside exported weights, so both loading paths rebuild the same shapes.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping

from torch import nn

from gatedprune.structures.adapters import AttentionSite, attention_sites, probe
from gatedprune.surgery.pruned_modeling import (
    CONFIG_KEY,
    install_runtime,
    layout_of,
    prune_attention,
    upgrade_record,
)

RECORD_FORMAT = 2
# the fields of Layout the runtime needs; they travel in the record so the saved directory describes itself
LAYOUT_FIELDS = (
    "q", "k", "v", "o", "head_dim_attr", "count_attrs", "kv_count_attrs", "group_attr", "inner_dim_attr",
    "position_bias_attr",
)

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
    """The record ``prune_heads`` keeps on ``model.config`` (see ``pruned_modeling``), or None if never pruned."""
    return getattr(model.config, CONFIG_KEY, None)


def _unpruned_record(model: nn.Module) -> dict:
    structure = probe(model)
    sites = attention_sites(model)
    kept_heads: dict[str, dict[str, list[int]]] = {}
    for site in sites:
        kept_heads.setdefault(site.kind, {})[site.path] = list(range(site.num_heads))
    return {
        "format": RECORD_FORMAT,
        "kept_heads": kept_heads,
        "num_heads": {site.path: site.num_heads for site in sites},
        "num_kv_heads": {site.path: site.num_kv_heads for site in sites},
        "slots": {site.path: list(range(site.num_heads)) for site in sites},
        "kv_heads": {site.path: list(range(site.num_kv_heads)) for site in sites},
        "layout": {
            stack: {
                **{f: list(v) if isinstance(v, tuple) else v for f in LAYOUT_FIELDS for v in [getattr(layout, f)]},
                "position_bias": structure.position_bias[stack],
            }
            for stack, layout in structure.layouts.items()
        },
        "rule": None,
    }


def grouped_slots(kept: list[int], slots: list[int], group: int) -> tuple[list[int], list[int], list[int]]:
    """Where grouped-query attention keeps query heads ``kept`` (original numbering): (slots, kv heads, fillers).

    Query head h reads key/value head h // ``group``. A key/value head stays while any of its query heads does,
    and every one that stays must serve the same number G' of query heads (the largest number kept in a group):
    groups with fewer kept heads are topped up with fillers, pruned heads taken from the current ``slots`` whose
    output columns are zeroed. Multi-head attention (group 1) has no fillers: slots = kv heads = kept.
    """
    alive = sorted({head // group for head in kept})  # kv heads that stay  (K',)
    width = max((sum(head // group == a for head in kept) for a in alive), default=0)  # G'
    new_slots, fillers = [], []
    for a in alive:
        members = [head for head in kept if head // group == a]
        spare = [head for head in slots if head // group == a and head not in kept][: width - len(members)]
        new_slots += sorted(members + spare)
        fillers += spare
    return new_slots, alive, fillers


def _next_slots(record: dict, site: AttentionSite, kept: list[int]):
    """(kept heads, slots, kv heads, fillers), original numbering, after keeping ``kept`` (current indices) of ``site``."""
    slots, before = record["slots"][site.path], record["kept_heads"][site.kind][site.path]
    now_kept = [slots[head] for head in kept if slots[head] in before]  # a kept filler is no head
    group = record["num_heads"][site.path] // record["num_kv_heads"][site.path]
    return (now_kept, *grouped_slots(now_kept, slots, group))


def prune_heads(model: nn.Module, plan: Plan, rule: str | None = None) -> nn.Module:
    """Shrink ``model`` in place to the heads ``plan`` keeps and record the plan on ``model.config``.

    Removes the q rows and output-projection columns of every other head of the named attention modules
    (encoder self-, decoder self- and cross-attention) and updates the head counts. With grouped key/value
    heads, a key/value head (its k/v rows) goes only when every query head that shares it goes, and a group
    left with fewer query heads than another keeps zero-output fillers (see ``grouped_slots``). The record on the
    config holds the kept heads in the original numbering, so pruning twice composes and
    ``model.save_pretrained(d)`` then ``load_pruned(d)`` round-trips. ``rule`` says how the plan was made.
    Prune a model without gates attached (``gates.remove()``): the gate hooks expect the old head count.
    """
    plan = check_plan(model, plan)
    sites = _sites(model)
    record = upgrade_record(copy.deepcopy(plan_record(model) or _unpruned_record(model)))
    for path, kept in plan.items():
        site = sites[path]
        if len(kept) == site.num_heads:
            continue
        slots, kv_heads = record["slots"][path], record["kv_heads"][path]
        now_kept, new_slots, new_kv, fillers = _next_slots(record, site, kept)
        prune_attention(
            site.module, [slots.index(h) for h in new_slots], [kv_heads.index(a) for a in new_kv],
            layout_of(record, path),
            fillers=[slots.index(h) for h in fillers],
        )
        record["kept_heads"][site.kind][path] = now_kept
        record["slots"][path], record["kv_heads"][path] = new_slots, new_kv
    if rule is not None:
        record["rule"] = rule
    setattr(model.config, CONFIG_KEY, record)
    install_runtime(model, record)
    return model


def cut_parameters(site: AttentionSite, query_heads: int, kv_heads: int) -> int:
    """Parameters that go with ``query_heads`` query heads and ``kv_heads`` key/value heads of ``site``.

    A query head owns its q rows (and biases), its output-projection columns and, where every layer owns a
    relative position bias, its column of it; a key/value head owns its k and v rows (and biases).
    """
    q, o = site.projection("q"), site.projection("o")
    per_query = site.head_dim * (q.in_features + (q.bias is not None) + o.out_features)
    if site.own_position_bias:
        per_query += getattr(site.module, site.layout.position_bias_attr).num_embeddings
    per_kv = sum(site.head_dim * (p.in_features + (p.bias is not None)) for p in map(site.projection, "kv"))
    return query_heads * per_query + kv_heads * per_kv


def removed_parameters(model: nn.Module, plan: Plan) -> int:
    """How many parameters ``prune_heads(model, plan)`` removes."""
    sites = _sites(model)
    record = upgrade_record(plan_record(model) or _unpruned_record(model))
    total = 0
    for path, kept in check_plan(model, plan).items():
        _, slots, kv_heads, _ = _next_slots(record, sites[path], kept)
        total += cut_parameters(
            sites[path], len(record["slots"][path]) - len(slots), len(record["kv_heads"][path]) - len(kv_heads)
        )
    return total


def record_removed_parameters(model: nn.Module) -> int:
    """How many parameters the pruning recorded on ``model`` removed, since it was whole."""
    record = upgrade_record(plan_record(model))
    return sum(
        cut_parameters(
            site, record["num_heads"][site.path] - len(record["slots"][site.path]),
            record["num_kv_heads"][site.path] - len(record["kv_heads"][site.path]),
        )
        for site in attention_sites(model)
    )


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())
