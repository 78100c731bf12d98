"""Remove structures physically: any plan in, a smaller model out that saves and reloads.

A plan is ``{module path: kept indices}``, counted among the module's current parts:

- an attention module -> its kept heads;
- a feed-forward block's output projection -> its kept intermediate units;
- a stack's ``ModuleList`` of layers -> its kept layers.

Modules it does not name keep everything. Gates (``HeadGates.plan()``), a baseline or a hand-written dict all produce
the same type; only ``prune_heads`` touches weights. The cutters (``prune_attention``, ``prune_ffn``,
``drop_layers``) live in ``pruned_modeling``, which is also written beside exported weights, so both loading paths
rebuild the same shapes. Heads and units of a layer the plan drops go with the layer.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping

from torch import nn

from gatedprune.structures.adapters import AttentionSite, attention_sites, probe
from gatedprune.structures.ffn import FFNSite, is_moe
from gatedprune.surgery.pruned_modeling import (
    CONFIG_KEY,
    PlanRecord,
    drop_layers,
    size_generation_cache,
    install_runtime,
    layout_of,
    prune_attention,
    prune_ffn,
)
from gatedprune.surgery.record import (  # noqa: F401  (the names below are this module's API as well)
    LAYOUT_FIELDS,
    RECORD_FORMAT,
    count_parameters,
    current_record,
    cut_parameters,
    cut_units,
    layer_removed,
    model_ffn_sites,
    plan_record,
    record_removed_parameters,
    rename_layers,
)

Plan = Mapping[str, Iterable[int]]


def _sites(model: nn.Module) -> dict[str, AttentionSite | FFNSite]:
    return {site.path: site for site in [*attention_sites(model), *model_ffn_sites(model)]}


def _indices(path: str, values, count: int, what: str, problems: list[str]) -> list[int]:
    """``values`` as sorted distinct integers in [0, count); each problem found is appended to ``problems``."""
    kept = []
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        problems.append(f"{path}: kept {what}s must be a list of {what} indices, got {values!r}")
        return kept
    for value in values:
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            problems.append(f"{path}: {what} {value!r} is not an integer")
            continue
        if not 0 <= value < count:
            problems.append(f"{path}: {what} {value} does not exist (the module has {what}s 0..{count - 1})")
        elif value in kept:
            problems.append(f"{path}: {what} {value} is listed twice")
        else:
            kept.append(value)
    return sorted(kept)


def check_plan(model: nn.Module, plan: Plan) -> dict[str, list[int]]:
    """Validate ``plan`` against ``model`` before anything is cut; returns it with sorted index lists.

    Raises ``ValueError`` naming every module that is not a prunable module of the model and every index that is
    not an integer in range, or is repeated; a plan that drops every decoder layer is refused.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"a plan is a mapping {{module path: kept indices}}, got {type(plan).__name__}")
    sites = _sites(model)
    stacks = {path: stack for stack, path in probe(model).layers.items()}
    unknown = [path for path in plan if path not in sites and path not in stacks]
    if unknown:
        examples = ", ".join([*list(sites)[:2], *stacks])
        raise ValueError(
            f"the plan names {len(unknown)} module(s) that are not prunable modules of this "
            f"{model.config.model_type} model: {unknown[:5]}; its attention modules, feed-forward output projections "
            f"and stacks of layers are named like {examples}"
        )
    problems, checked = [], {}
    for path, values in plan.items():
        if path in stacks:
            checked[path] = _indices(path, values, len(model.get_submodule(path)), "layer", problems)
            layers = model.get_submodule(path)
            if stacks[path] == "decoder" and not checked[path] and len(layers):
                problems.append(f"{path}: a decoder keeps at least one layer (the plan keeps none)")
            if len(checked[path]) < len(layers) and any(is_moe(layer) for layer in layers):
                problems.append(f"{path}: its layers hold a mixture of experts placed by layer index, so none can go")
        else:
            site = sites[path]
            what = "head" if isinstance(site, AttentionSite) else "unit"
            checked[path] = _indices(path, values, site.num_units, what, problems)
    if problems:
        raise ValueError("invalid plan:\n  " + "\n  ".join(problems))
    return checked


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


def _in_dropped(path: str, plan: dict, stacks: dict[str, str]) -> bool:
    for layers_path in stacks.values():
        if path.startswith(layers_path + ".") and layers_path in plan:
            return int(path[len(layers_path) + 1:].partition(".")[0]) not in plan[layers_path]
    return False


def prune_heads(model: nn.Module, plan: Plan, rule: str | None = None) -> nn.Module:
    """Shrink ``model`` in place to what ``plan`` keeps and record the plan on ``model.config``.

    Heads: the q rows and output-projection columns of every other head go, and the head counts follow; with grouped
    key/value heads, a key/value head (its k/v rows) goes only when every query head that shares it goes, and a group
    left with fewer query heads than another keeps zero-output fillers (see ``grouped_slots``). Units: their rows of
    the feed-forward input projection(s) and their output-projection column. Layers: dropped from their stack, what
    indexes them renumbered (see ``drop_layers``). The record on the config holds what is kept in the original
    numbering, so pruning twice composes and ``model.save_pretrained(d)`` then ``load_pruned(d)`` round-trips.
    ``rule`` says how the plan was made. Prune a model without gates attached (``gates.remove()``).
    """
    plan = check_plan(model, plan)
    sites = _sites(model)
    structure = probe(model)
    record = PlanRecord(copy.deepcopy(current_record(model)))
    for path, kept in plan.items():
        site = sites.get(path)
        if site is None or _in_dropped(path, plan, structure.layers) or len(kept) == site.num_units:
            continue
        if isinstance(site, FFNSite):
            units = record["kept_units"][site.kind][path]
            prune_ffn(site.container, kept, record["layout"][stack_of(site)]["ffn"])
            record["kept_units"][site.kind][path] = [units[u] for u in kept]
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
    for stack, layers_path in structure.layers.items():
        kept = plan.get(layers_path)
        layers = model.get_submodule(layers_path)
        if kept is None or len(kept) == len(layers):
            continue
        attention = {s.path: s for s in attention_sites(model)}
        ffns = {s.path: s for s in model_ffn_sites(model)}
        going = [i for i in range(len(layers)) if i not in kept]
        moved = drop_layers(model, layers_path, kept, stack, record["layout"][stack])
        for i in going:
            entry = layer_removed(record, layers[i], f"{layers_path}.{i}", attention, ffns, moved if i == 0 else 0)
            record["dropped"].setdefault(stack, []).append({"layer": record["kept_layers"][stack][i], **entry})
        record["kept_layers"][stack] = [record["kept_layers"][stack][i] for i in kept]
        rename_layers(record, layers_path, kept)
        setattr(model.config, CONFIG_KEY, record)  # an emptied encoder is found by its record (probe)
    size_generation_cache(model, len(model.get_submodule(structure.layers["decoder"])))
    if rule is not None:
        record["rule"] = rule
    setattr(model.config, CONFIG_KEY, record)
    install_runtime(model, record)
    return model


def stack_of(site) -> str:
    """The stack a site belongs to."""
    return "encoder" if site.kind.startswith("encoder") else "decoder"


def removed_parameters(model: nn.Module, plan: Plan) -> int:
    """How many parameters ``prune_heads(model, plan)`` removes."""
    plan = check_plan(model, plan)
    sites = _sites(model)
    structure = probe(model)
    record = current_record(model)
    total = 0
    for path, kept in plan.items():
        site = sites.get(path)
        if site is None or _in_dropped(path, plan, structure.layers):
            continue
        if isinstance(site, FFNSite):
            total += cut_units(site, site.width - len(kept))
            continue
        _, slots, kv_heads, _ = _next_slots(record, site, kept)
        total += cut_parameters(site, len(record["slots"][path]) - len(slots), len(record["kv_heads"][path]) - len(kv_heads))
    for stack, layers_path in structure.layers.items():
        layers = model.get_submodule(layers_path)
        kept = plan.get(layers_path, range(len(layers)))
        for i in (i for i in range(len(layers)) if i not in kept):
            total += sum(p.numel() for p in layers[i].parameters())
        layout = record["layout"][stack]
        table = getattr(_attr_path(layers[0], layout["self_attention"]) if len(layers) else None,
                        layout.get("position_bias_attr") or "", None)
        if kept and 0 not in kept and layout.get("position_bias") == "shared" and isinstance(table, nn.Embedding):
            total -= table.weight.numel()  # moves to the new first layer
    return total


def _attr_path(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
