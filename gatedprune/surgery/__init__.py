"""The one place that cuts (``cut``), the pruned runtime copied into every export (``pruned_modeling``), and loading
models pruned or not (``model_loading``).

``gatedprune.surgery`` was one module before the package had subfolders: its names still resolve here, each from
the module that holds it now (looked up on first use, so importing this package imports none of them).
"""

_MOVED = {
    **dict.fromkeys(("Plan", "RECORD_FORMAT", "LAYOUT_FIELDS", "check_plan", "plan_record", "grouped_slots",
                     "prune_heads", "cut_parameters", "removed_parameters", "record_removed_parameters",
                     "count_parameters"), "gatedprune.surgery.cut"),
    **dict.fromkeys(("ENCODER_DECODER_MAPPINGS", "family_class", "auto_class", "fresh_model", "load_pruned"),
                    "gatedprune.surgery.model_loading"),
    "masked_heads": "gatedprune.structures.masking",
}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'gatedprune.surgery' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_MOVED[name]), name)
