"""``--format onnx``: the encoder and one cached decoder step as ONNX graphs, verified in ONNX Runtime against the
PyTorch model, with the greedy loop that drives them (``onnx_greedy``, which documents the graphs).

Exported with ``torch.onnx.export(dynamo=True)`` (``torch.export``, then onnxscript): it traces these models,
pruned or not, through transformers' cache objects with symbolic batch, source and cache lengths, so a graph is
general in them or the export fails (the TorchScript exporter, deprecated since torch 2.9, exports about 5x faster
but records the sizes Python code computes with as constants, right only at the traced shapes). The graphs are
traced from small wrappers around the model itself, so whatever the pruned runtime does (per-layer head counts,
head sizes that are not d_model / heads, a layer's phantom head of zeros, the shared position bias of T5, dropped
layers, an encoder without layers) is in them as it is in PyTorch; the cache shapes come from running the model,
not from its config. The decoder step rebuilds transformers' ``EncoderDecoderCache`` from the flat tensors it is
given, so the model's own code takes its position from the cache length (learned positions, T5's relative bias)
and reuses the cross-attention keys and values the encoder graph computed with the decoder's own k/v projections.

Verified on the verification batch: ONNX Runtime's greedy tokens equal ``generate()``'s, and at every step of its
path (the first included, run to ``max_new_tokens`` past EOS) its logits are within ``LOGIT_TOLERANCE`` of the
PyTorch model's, decoding beside it with its own cache on the same ids.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from gatedprune.deploy import onnx_greedy, verify
from gatedprune.deploy.onnx_greedy import CONFIG_FILE, ENCODER_FILE, STEP_FILE, OnnxSeq2Seq, cache_name
from gatedprune.structures.adapters import probe
from gatedprune.surgery.pruned_modeling import attr

FAMILIES = ("bart", "mbart", "marian", "m2m_100", "t5", "mt5")
NAME = "onnxruntime"  # how verification messages name the runtime
LOGIT_TOLERANCE = 1e-4  # per unit of the largest |logit| (at least 1): float32 both sides, fused kernels in ORT
LOOP_FILE = "onnx_greedy.py"  # a copy of gatedprune.deploy.onnx_greedy, for users without gatedprune
EXAMPLE = {"batch": 2, "source": 6, "past": 3}  # the traced example; every one of these dims is symbolic in the graph


def _per_layer(own: list, cross: list) -> list:
    """Self and cross caches interleaved per layer, (self k, self v, cross k, cross v) x L: the order of the step's
    inputs (optimum's, which zips its flattened cache onto the graph's inputs in this order)."""
    return [x for i in range(0, len(own), 2) for x in (*own[i: i + 2], *cross[i: i + 2])]


class EncoderGraph(nn.Module):
    """input_ids, attention_mask (B, S) -> last_hidden_state (B, S, d), then each decoder layer's cross keys and
    values (B, H_i, S, D_i), projected here as the cross-attention modules project them on their first call (the
    layout table names the projections; a module without heads hands out its phantom head through its hooks).
    Verification compares what the step then computes with them against PyTorch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        structure = probe(model)
        _, inner = structure.attention["cross"]
        layout = structure.layouts["decoder"]
        modules = [layer.get_submodule(inner) for layer in model.get_submodule(structure.layers["decoder"])]
        self.projections = nn.ModuleList(attr(m, name) for m in modules for name in (layout.k, layout.v))
        self.head_dims = [int(attr(m, layout.head_dim_attr)) for m in modules for _ in range(2)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        batch, source = input_ids.shape
        cross = [projection(hidden).view(batch, source, -1, head_dim).transpose(1, 2)  # (B, H_i, S, D_i)
                 for projection, head_dim in zip(self.projections, self.head_dims)]
        return (hidden, *cross)


class DecoderStep(nn.Module):
    """One decoder token from flat caches: input_ids (B, 1), encoder_attention_mask (B, S), then per layer the
    self-attention key, value (B, H_i, T, D_i) and the cross key, value (B, H_i, S, D_i) -> logits (B, 1, V) and
    the self-attention caches grown to T + 1."""

    def __init__(self, model: nn.Module, layers: int):
        super().__init__()
        self.model, self.layers = model, layers
        self.width = model.get_input_embeddings().embedding_dim

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, *caches: torch.Tensor):
        own = [caches[4 * i: 4 * i + 2] for i in range(self.layers)]  # [(k, v)] per layer
        cross = [caches[4 * i + 2: 4 * i + 4] for i in range(self.layers)]
        cache = EncoderDecoderCache(DynamicCache(own), DynamicCache(cross))
        cache.is_updated = {i: True for i in range(self.layers)}  # cross k/v given: no layer projects them again
        batch, source = encoder_attention_mask.shape
        # read for its shape only (the cross k/v come from the cache); verification would see any other use
        placeholder = encoder_attention_mask.new_zeros(batch, source, self.width, dtype=cross[0][0].dtype)  # (B, S, d)
        out = self.model(encoder_outputs=(placeholder,), attention_mask=encoder_attention_mask,
                         decoder_input_ids=input_ids, cache=cache, use_cache=True)
        grown = [t for layer in out.cache.self_attention_cache.layers for t in (layer.keys, layer.values)]
        return (out.logits, *grown)


def check(model: nn.Module, quantization: str | None = None, **_) -> None:
    if quantization not in (None, "float32"):
        raise ValueError(f"--quantization {quantization} applies to --format ct2; --format onnx writes float32; "
                         f"allowed: float32 or none")


@torch.no_grad()
def _example(model: nn.Module) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """Traced inputs: a padded source batch, and the self and cross caches PyTorch builds for it."""
    b, s, t = EXAMPLE["batch"], EXAMPLE["source"], EXAMPLE["past"]
    vocab = model.get_input_embeddings().weight.shape[0]
    input_ids = torch.arange(b * s).reshape(b, s) % vocab  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, s // 2:] = 0  # a padded row: the masks are traced as data, not as constants
    decoder_ids = torch.full((b, t), verify.decoder_start(model))  # (B, T)
    out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids, use_cache=True)
    own = [x for layer in out.cache.self_attention_cache.layers for x in (layer.keys, layer.values)]
    cross = [x for layer in out.cache.cross_attention_cache.layers for x in (layer.keys, layer.values)]
    return {"input_ids": input_ids, "attention_mask": attention_mask}, own, cross


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
            dynamic_shapes) -> int:
    """Export ``module`` to ``path`` (weights beside it when past protobuf's 2 GB); returns the opset."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notes about torch internals
        program = torch.onnx.export(module, args, dynamo=True, input_names=inputs, output_names=outputs,
                                    dynamic_shapes=dynamic_shapes, optimize=True, verify=False, report=False,
                                    verbose=False)
    program.save(str(path), external_data=None)
    return next(o.version for o in program.model_proto.opset_import if o.domain in ("", "ai.onnx"))


def export(model: nn.Module, stage: Path) -> dict:
    """Write both graphs and ``onnx_config.json`` into ``stage``; returns the config."""
    # "torchvision is not installed, skipping torchvision::nms", once per process: not the user's concern
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    example, own, cross = _example(model)
    layers = len(own) // 2
    batch, source, past = torch.export.Dim("batch"), torch.export.Dim("source"), torch.export.Dim("past", min=0)
    kinds = ("key", "value")
    cross_names = [cache_name(i, "encoder", k) for i in range(layers) for k in kinds]
    own_names = [cache_name(i, "decoder", k) for i in range(layers) for k in kinds]
    present = [cache_name(i, "decoder", k, prefix="present") for i in range(layers) for k in kinds]
    opset = _export(EncoderGraph(model), (example["input_ids"], example["attention_mask"]), stage / ENCODER_FILE,
                    ["input_ids", "attention_mask"], ["last_hidden_state", *cross_names],
                    {"input_ids": {0: batch, 1: source}, "attention_mask": {0: batch, 1: source}})
    step_ids = torch.full((EXAMPLE["batch"], 1), verify.decoder_start(model))  # (B, 1)
    step_inputs = ["input_ids", "encoder_attention_mask", *_per_layer(own_names, cross_names)]
    _export(DecoderStep(model, layers), (step_ids, example["attention_mask"], *_per_layer(own, cross)),
            stage / STEP_FILE, step_inputs, ["logits", *present],
            {"input_ids": {0: batch}, "encoder_attention_mask": {0: batch, 1: source},
             "caches": tuple(_per_layer([{0: batch, 2: past}] * len(own), [{0: batch, 2: source}] * len(cross)))})
    shape = lambda x: {"heads": x.shape[1], "head_dim": x.shape[3]}  # noqa: E731  (B, H, T, D)
    config = {
        "format": 1,
        "family": model.config.model_type,
        "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        "opset": opset,
        "tokens": {"decoder_start": verify.decoder_start(model), "eos": verify.eos_ids(model),
                   "pad": model.config.pad_token_id, "forced_first": verify.forced_first(model)},
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "encoder": {"file": ENCODER_FILE, "inputs": ["input_ids", "attention_mask"],
                    "outputs": ["last_hidden_state", *cross_names], "cross_outputs": cross_names},
        "decoder_step": {
            "file": STEP_FILE, "inputs": step_inputs,
            "outputs": ["logits", *present],
            "caches": [{"input": i, "output": o, **shape(x)} for i, o, x in zip(own_names, present, own)]},
        "layers": [{"self_attention": shape(own[2 * i]), "cross_attention": shape(cross[2 * i])}
                   for i in range(layers)],
    }
    (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return config


class _LockstepLogits:
    """The PyTorch model decoding beside ONNX Runtime, fed the ids ONNX Runtime fed itself (its own cache, as
    ``generate()`` runs it): the largest |logit difference| of every step, one step's logits in memory at a time."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.model, self.attention_mask = model, attention_mask
        self.encoded = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.diffs, self.scale = [], 1.0

    def __call__(self, step: int, fed: np.ndarray, logits: np.ndarray) -> None:
        out = self.model(encoder_outputs=self.encoded, attention_mask=self.attention_mask, cache=self.cache,
                         decoder_input_ids=torch.from_numpy(fed)[:, None], use_cache=True)
        want, got = out.logits[:, -1].float(), torch.from_numpy(logits)  # (B, V)
        diff = torch.where(want == got, 0.0, (want - got).abs())  # equal infinities (a banned token) differ by 0
        self.diffs.append(diff.max().item())
        finite = want[want.isfinite()]
        self.scale = max(self.scale, finite.abs().max().item() if finite.numel() else 0.0)


@torch.no_grad()
def check_runtime(model: nn.Module, runtime: OnnxSeq2Seq, batch: dict, max_new_tokens: int) -> dict:
    """Greedy tokens against ``generate()``'s, and every step's logits against the PyTorch model's on the ids
    ONNX Runtime fed itself, run to ``max_new_tokens`` past EOS (a first EOS leaves the cache otherwise unchecked)."""
    input_ids, attention_mask = batch["input_ids"].long().cpu(), batch["attention_mask"].long().cpu()
    lockstep = _LockstepLogits(model, input_ids, attention_mask)
    tokens = runtime.generate(input_ids.numpy(), attention_mask.numpy(), max_new_tokens, stop_at_eos=False,
                              on_step=lockstep)  # (B, N)
    check = verify.compare_tokens(NAME, [runtime.until_eos(row) for row in tokens],
                                  verify.greedy_reference(model, batch, max_new_tokens))
    tolerance = LOGIT_TOLERANCE * lockstep.scale
    check.update({"first_step_max_abs_logit_diff": lockstep.diffs[0] if lockstep.diffs else 0.0,
                  "max_abs_logit_diff": max(lockstep.diffs, default=0.0), "logit_tolerance": tolerance,
                  "steps_compared": len(lockstep.diffs)})
    check["passed"] = check["greedy_identical"] and check["max_abs_logit_diff"] <= tolerance
    return check


def write(model: nn.Module, stage: Path, *, tokenizer=None, batch: dict, max_new_tokens: int, **_) -> dict:
    model = model if next(model.parameters()).device.type == "cpu" else copy.deepcopy(model).cpu()
    config = export(model, stage)
    import onnxruntime

    runtime = OnnxSeq2Seq(stage, threads=torch.get_num_threads())
    check = check_runtime(model, runtime, batch, max_new_tokens)
    if not check["passed"]:
        what = (verify.describe_difference(NAME, check) if not check["greedy_identical"] else
                f"logits differ by {check['max_abs_logit_diff']:.3g} (tolerance {check['logit_tolerance']:.3g}; "
                f"first step {check['first_step_max_abs_logit_diff']:.3g})")
        raise verify.DeployError(f"ONNX Runtime does not give the PyTorch model's outputs: {what}; nothing was written")
    shutil.copyfile(onnx_greedy.__file__, stage / LOOP_FILE)  # the loop travels too: numpy and onnxruntime only
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    files = {p.relative_to(stage).as_posix(): p.stat().st_size for p in sorted(stage.rglob("*")) if p.is_file()}
    return {"exporter": config["exporter"], "opset": config["opset"], "onnxruntime": onnxruntime.__version__,
            "graphs": {"encoder": ENCODER_FILE, "decoder_step": STEP_FILE}, "config": CONFIG_FILE, "loop": LOOP_FILE,
            "layers": config["layers"], "tokens": config["tokens"], "files": files,
            "bytes": sum(files.values()), "verification": check}
