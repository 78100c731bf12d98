"""``--format ct2``: a CTranslate2 model directory, verified in CTranslate2 against the PyTorch model.

The spec is built from the weights (``ct2_spec``), not by CTranslate2's converter: that converter loads the stock
transformers class (no pruned shapes) and, for BART-like configs, reads ``config.normalize_before``, which
transformers v5 no longer has. Checked in float32 on the verification batch: CTranslate2's greedy tokens equal
``generate()``'s, and the log-probabilities of the references (``score_batch``; of the greedy tokens when the
batch has no references) are within ``SCORE_TOLERANCE`` of the PyTorch model's: token equality alone can flip on
near-ties of a barely trained model, so the scores say how close. A quantized export (``--quantization int8``) is
checked to load and translate, and its BLEU is reported beside float32's when there are references.

Use: ``ctranslate2.Translator(directory).translate_batch(tokens, beam_size=1)`` with the tokenizer files that
travel in the directory; ``deploy_report.json`` gives ``target_prefix`` when the model forces a first token (a
target-language code).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from torch import nn

from gatedprune.deploy import verify
from gatedprune.deploy.ct2_spec import CT2_LAYOUTS, build_spec, is_pre_norm
from gatedprune.structures.adapters import attention_sites

FAMILIES = tuple(CT2_LAYOUTS)
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16")
SCORE_TOLERANCE = 1e-4  # largest |log-probability difference| per target token, float32 CTranslate2 vs PyTorch
# (an exact conversion differs by about 1e-6: float32 sums in another order)


def check_options(quantization: str | None = None, **_) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization} is not one of CTranslate2's; allowed: {', '.join(QUANTIZATIONS)}")


def check(model: nn.Module, quantization: str | None = None, **_) -> None:
    check_options(quantization)
    sizes = {model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0]}
    if len(sizes) > 1 or getattr(model.config, "share_encoder_decoder_embeddings", True) is False:
        raise ValueError(f"--format ct2: this {model.config.model_type} model has separate source and target "
                         f"vocabularies, which this export does not map; allowed: one shared vocabulary")
    if not attention_sites(model, ["encoder"]) and not is_pre_norm(model):
        raise ValueError(f"--format ct2: this {model.config.model_type} model has no encoder layer left, and "
                         f"CTranslate2 needs one; a post-norm family has no layer that adds nothing; allowed: "
                         f"a plan that keeps an encoder layer, or a pre-norm family (mbart, m2m_100, t5, mt5)")
    kv = [s for s in attention_sites(model) if s.num_kv_heads != s.num_heads]
    if kv:
        raise ValueError(f"--format ct2: {kv[0].path} has grouped key/value heads ({kv[0].num_kv_heads} for "
                         f"{kv[0].num_heads} query heads), which this export does not map; allowed: "
                         f"{', '.join(FAMILIES)} with one key/value head per query head")


def vocabulary(model: nn.Module, tokenizer=None) -> list[str]:
    """One distinct token per embedding row, in id order: the tokenizer's, and ``<unused_ID>`` where it has none
    (ids past the tokenizer, or no tokenizer: the ids are then the tokens)."""
    size = model.get_input_embeddings().weight.shape[0]
    tokens = [None] * size
    if tokenizer is not None:
        for token, token_id in tokenizer.get_vocab().items():
            if token_id < size:
                tokens[token_id] = token
    seen: set[str] = set()
    for i, token in enumerate(tokens):
        if token is None or token in seen:
            tokens[i] = f"<unused_{i}>"
        seen.add(tokens[i])
    return tokens


def save(model: nn.Module, tokens: list[str], directory: Path, quantization: str | None) -> dict:
    spec, padding = build_spec(model, tokens)
    spec.validate()
    spec.optimize(quantization=quantization)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return padding


def _translator(directory: Path, compute_type: str, threads: int = 1):
    import ctranslate2

    return ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type, inter_threads=1,
                                  intra_threads=threads)


def translate(translator, model: nn.Module, tokens: list[str], source_ids: list[list[int]],
              max_new_tokens: int) -> list[list[int]]:
    """CTranslate2's greedy ids per source, generated tokens only, up to the first EOS (as ``verify`` frames them)."""
    index = {token: i for i, token in enumerate(tokens)}
    forced = verify.forced_first(model)
    prefix = [[tokens[forced]]] * len(source_ids) if forced is not None else None
    results = translator.translate_batch(
        [[tokens[i] for i in ids] for ids in source_ids], target_prefix=prefix, beam_size=1,
        max_decoding_length=max_new_tokens, min_decoding_length=0, return_end_token=True,
    )
    eos = model.config.eos_token_id
    return [verify.until_eos([index[t] for t in r.hypotheses[0]], eos) for r in results]


@torch.no_grad()
def _pytorch_scores(model: nn.Module, source_ids: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
    """log p(target token | prefix) under the PyTorch model, for each target (its EOS included)."""
    start, eos = verify.decoder_start(model), model.config.eos_token_id
    scores = []
    for ids, target in zip(source_ids, targets):
        labels = torch.tensor([target + [eos]])  # (1, T)
        decoder_inputs = torch.tensor([[start] + target])  # (1, T)
        logits = model(input_ids=torch.tensor([ids]), decoder_input_ids=decoder_inputs).logits.float()  # (1, T, V)
        scores.append(logits.log_softmax(-1).gather(-1, labels[..., None])[0, :, 0].tolist())
    return scores


def _score_check(translator, model, tokens, source_ids, targets) -> dict:
    results = translator.score_batch([[tokens[i] for i in ids] for ids in source_ids],
                                     [[tokens[i] for i in t] for t in targets])
    want = _pytorch_scores(model, source_ids, targets)
    diffs = [abs(a - b) for r, w in zip(results, want) for a, b in zip(r.log_probs, w)]
    lengths_match = all(len(r.log_probs) == len(w) for r, w in zip(results, want))
    return {"scored_tokens": len(diffs), "max_abs_logprob_diff": max(diffs, default=0.0),
            "tolerance": SCORE_TOLERANCE, "lengths_match": lengths_match}


def _references(batch: dict, model: nn.Module) -> list[list[int]] | None:
    """The reference targets of the batch (labels without their framing EOS and padding), if it has labels."""
    labels = batch.get("labels")
    if labels is None:
        return None
    eos = model.config.eos_token_id
    return [verify.until_eos([t for t in row.tolist() if t != -100], eos) for row in labels]


def _bleu(tokenizer, hypotheses: list[list[int]], references: list[list[int]]) -> float:
    import sacrebleu

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return sacrebleu.corpus_bleu([decode(h) for h in hypotheses], [[decode(r) for r in references]]).score


def tokens_per_second(translator, model, tokens, source_ids, max_new_tokens, repeats: int = 3) -> float:
    """Greedy decoding speed of ``translator`` on the verification sources (best of ``repeats``, one batch)."""
    best = float("inf")
    produced = 0
    for _ in range(repeats):
        started = time.process_time()
        out = translate(translator, model, tokens, source_ids, max_new_tokens)
        best = min(best, time.process_time() - started)
        produced = sum(len(ids) + (len(ids) < max_new_tokens) for ids in out)  # and the EOS, where one ended it
    return produced / max(best, 1e-9)


def write(model: nn.Module, stage: Path, *, tokenizer=None, batch: dict, max_new_tokens: int,
          quantization: str | None = None, dense: nn.Module | None = None, **_) -> dict:
    """``dense``: the model before pruning (same weights, every structure), converted beside it for the speed-up
    in CTranslate2 (same sources, greedy, one thread); not kept."""
    tokens = vocabulary(model, tokenizer)
    source_ids = verify.sources(batch)
    float32_dir = stage / ".float32" if quantization not in (None, "float32") else stage
    padding = save(model, tokens, float32_dir, None)
    translator = _translator(float32_dir, "float32")
    want = verify.greedy_reference(model, batch, max_new_tokens)
    got = translate(translator, model, tokens, source_ids, max_new_tokens)
    check = verify.compare_tokens("ct2", got, want)
    references = _references(batch, model)
    scored = references if references is not None else want
    check.update(_score_check(translator, model, tokens, source_ids, scored))
    check["scored"] = "references" if references is not None else "greedy tokens"
    check["passed"] = (check["greedy_identical"] and check["lengths_match"]
                       and check["max_abs_logprob_diff"] <= SCORE_TOLERANCE)
    if not check["passed"]:
        what = (verify.describe_difference("ct2", check) if not check["greedy_identical"] else
                f"log-probabilities of {check['scored']} differ by {check['max_abs_logprob_diff']:.3g} "
                f"(tolerance {SCORE_TOLERANCE:g}; lengths match: {check['lengths_match']})")
        raise verify.DeployError(f"CTranslate2 float32 does not give the PyTorch model's outputs: {what}; "
                                 f"nothing was written")
    report = {"quantization": quantization or "float32", "vocabulary_size": len(tokens), **padding,
              "target_prefix": None if verify.forced_first(model) is None else tokens[verify.forced_first(model)],
              "verification": check,
              "tokens_per_second": {"float32": tokens_per_second(translator, model, tokens, source_ids,
                                                                 max_new_tokens)}}
    if references is not None and tokenizer is not None:  # greedy, at most max_new_tokens: the verification's decode
        report["bleu"] = {"float32": _bleu(tokenizer, got, references), "pairs": len(references),
                          "max_new_tokens": max_new_tokens}
    if float32_dir != stage:  # the requested quantization: loads, translates, and how far it moved
        save(model, tokens, stage, quantization)
        shutil.rmtree(float32_dir)
        quantized = _translator(stage, "default")  # the type the weights were saved in (where the CPU has it)
        out = translate(quantized, model, tokens, source_ids, max_new_tokens)
        report["quantized"] = {"compute_type": quantized.compute_type, "translated": len(out),
                               "greedy_identical_to_float32": out == got,
                               "tokens_per_second": tokens_per_second(quantized, model, tokens, source_ids,
                                                                      max_new_tokens)}
        if "bleu" in report:
            report["bleu"][quantization] = _bleu(tokenizer, out, references)
    if dense is not None:
        report["tokens_per_second"].update(_dense_speed(dense, tokens, stage, source_ids, max_new_tokens,
                                                        report["tokens_per_second"]["float32"]))
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    return report


def _dense_speed(dense: nn.Module, tokens, stage: Path, source_ids, max_new_tokens: int, pruned: float) -> dict:
    directory = stage / ".dense"
    save(dense, tokens, directory, None)
    try:
        speed = tokens_per_second(_translator(directory, "float32"), dense, tokens, source_ids, max_new_tokens)
    finally:
        shutil.rmtree(directory)
    return {"dense_float32": speed, "pruned_over_dense": pruned / speed}
