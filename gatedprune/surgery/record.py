"""The plan record a pruned model carries on its config (``config.gatedprune``, format in ``pruned_modeling``):
how it is started for a model never pruned, kept in step when layers go, and what it says was removed."""

from __future__ import annotations

from torch import nn

from gatedprune.structures.adapters import AttentionSite, attention_sites, probe
from gatedprune.structures.ffn import FFNError, FFNSite, ffn_record, ffn_sites
from gatedprune.structures.kinds import ffn_kind
from gatedprune.surgery.pruned_modeling import CONFIG_KEY, upgrade_record

RECORD_FORMAT = 3
# the fields of Layout the runtime needs; they travel in the record so the saved directory describes itself
LAYOUT_FIELDS = (
    "q", "k", "v", "o", "head_dim_attr", "count_attrs", "kv_count_attrs", "group_attr", "inner_dim_attr",
    "position_bias_attr", "bias_flag_attr",
)
PER_PATH = ("num_heads", "num_kv_heads", "slots", "kv_heads", "num_units")  # record fields keyed by module path
PER_KIND = ("kept_heads", "kept_units")  # {kind: {path: ...}}


def plan_record(model: nn.Module) -> dict | None:
    """The record ``prune_heads`` keeps on ``model.config``, or None if never pruned."""
    return getattr(model.config, CONFIG_KEY, None)


def model_ffn_sites(model: nn.Module) -> list[FFNSite]:
    """The feed-forward blocks of both stacks, where the stack has blocks of a known layout (none for a MoE)."""
    structure, sites = probe(model), []
    for stack, path in structure.layers.items():
        try:
            sites += ffn_sites(model, stack, path, ffn_kind(stack))
        except FFNError:
            pass
    return sites


def _unpruned_record(model: nn.Module) -> dict:
    structure = probe(model)
    sites = attention_sites(model)
    ffns = model_ffn_sites(model)
    kept_heads: dict[str, dict[str, list[int]]] = {}
    for site in sites:
        kept_heads.setdefault(site.kind, {})[site.path] = list(range(site.num_heads))
    layout = {}
    for stack, described in structure.layouts.items():
        first = next((s for s in ffns if s.kind == ffn_kind(stack)), None)
        layout[stack] = {
            **{f: list(v) if isinstance(v, tuple) else v for f in LAYOUT_FIELDS for v in [getattr(described, f)]},
            "position_bias": structure.position_bias[stack], "name": described.name,
            "layers": structure.layers[stack],
            "self_attention": structure.attention["encoder" if stack == "encoder" else "decoder"][1],
            "cross_attention": structure.attention["cross"][1] if stack == "decoder" else None,
            "ffn": ffn_record(first) if first else None,
        }
    return {
        "format": RECORD_FORMAT,
        "kept_heads": kept_heads,
        "num_heads": {site.path: site.num_heads for site in sites},
        "num_kv_heads": {site.path: site.num_kv_heads for site in sites},
        "slots": {site.path: list(range(site.num_heads)) for site in sites},
        "kv_heads": {site.path: list(range(site.num_kv_heads)) for site in sites},
        "kept_units": {kind: {s.path: list(range(s.width)) for s in ffns if s.kind == kind}
                       for kind in dict.fromkeys(s.kind for s in ffns)},
        "num_units": {s.path: s.width for s in ffns},
        "kept_layers": {stack: list(range(len(model.get_submodule(path)))) for stack, path in structure.layers.items()},
        "num_layers": {stack: len(model.get_submodule(path)) for stack, path in structure.layers.items()},
        "dropped": {},
        "layout": layout,
        "rule": None,
    }


def current_record(model: nn.Module) -> dict:
    """The model's record in format 3 (a fresh one if never pruned); what an older record does not name (units and
    layers, before format 3) is filled in as untouched."""
    record = plan_record(model)
    if record is None:
        return _unpruned_record(model)
    record = upgrade_record(record)
    if record.get("kept_layers") and all(s in record["kept_layers"] for s in ("encoder", "decoder")):
        return record
    fresh = _unpruned_record(model)
    for field in ("kept_units", "num_units", "kept_layers", "num_layers"):
        record[field] = {**fresh[field], **record.get(field, {})}
    for stack, described in fresh["layout"].items():
        record["layout"][stack] = {**described, **record["layout"][stack]}
    return record


def rename_layers(record: dict, layers_path: str, kept: list[int]) -> None:
    """Re-key every per-path field after a stack kept layers ``kept`` (current indices): ``<layers>.<old>.`` becomes
    ``<layers>.<new>.``; the entries of the dropped layers go."""
    new_index = {old: new for new, old in enumerate(kept)}
    prefix = layers_path + "."

    def renamed(path: str) -> str | None:
        if not path.startswith(prefix):
            return path
        index, _, rest = path[len(prefix):].partition(".")
        return f"{prefix}{new_index[int(index)]}.{rest}" if int(index) in new_index else None

    for field in PER_PATH:
        record[field] = {renamed(p): v for p, v in record.get(field, {}).items() if renamed(p) is not None}
    for field in PER_KIND:
        record[field] = {kind: {renamed(p): v for p, v in per.items() if renamed(p) is not None}
                         for kind, per in record.get(field, {}).items()}


def cut_parameters(site: AttentionSite, query_heads: int, kv_heads: int) -> int:
    """Parameters that go with ``query_heads`` query heads and ``kv_heads`` key/value heads of ``site``
    (``AttentionSite.head_parameters``)."""
    per_query, per_kv = site.head_parameters()
    return query_heads * per_query + kv_heads * per_kv


def cut_units(site: FFNSite, units: int) -> int:
    """Parameters that go with ``units`` intermediate units of a feed-forward block."""
    return units * site.unit_parameters()


def layer_removed(record: dict, layer: nn.Module, layer_path: str, attention: dict, ffns: dict, moved: int) -> dict:
    """The entry ``dropped`` gets for a layer going now: its parameters as they were before any cut (what it holds
    now, plus what earlier cuts of its heads and units removed), less a position bias that moves on."""
    prefix = layer_path + "."
    earlier = sum(
        cut_parameters(site, record["num_heads"][p] - len(record["slots"][p]),
                       record["num_kv_heads"][p] - len(record["kv_heads"][p]))
        for p, site in attention.items() if p.startswith(prefix)
    ) + sum(cut_units(site, record["num_units"][p] - len(_kept_units(record, p))) for p, site in ffns.items()
            if p.startswith(prefix) and p in record["num_units"])
    heads = {kind: sum(record["num_heads"][p] for p in per if p.startswith(prefix))
             for kind, per in record["kept_heads"].items()}
    units = {kind: sum(record["num_units"][p] for p in per if p.startswith(prefix))
             for kind, per in record["kept_units"].items()}
    return {"parameters": sum(p.numel() for p in layer.parameters()) + earlier - moved,
            "heads": {k: v for k, v in heads.items() if v}, "units": {k: v for k, v in units.items() if v}}


def _kept_units(record: dict, path: str) -> list[int]:
    return next(per[path] for per in record["kept_units"].values() if path in per)


def record_removed_parameters(model: nn.Module) -> int:
    """How many parameters the pruning recorded on ``model`` removed, since it was whole."""
    record = current_record(model)
    heads = sum(
        cut_parameters(
            site, record["num_heads"][site.path] - len(record["slots"][site.path]),
            record["num_kv_heads"][site.path] - len(record["kv_heads"][site.path]),
        )
        for site in attention_sites(model)
    )
    units = sum(cut_units(site, record["num_units"][site.path] - site.width) for site in model_ffn_sites(model)
                if site.path in record["num_units"])
    return heads + units + sum(entry["parameters"] for entries in record["dropped"].values() for entry in entries)


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())
