"""``--format hf-portable``: plans the stock classes can hold are written as the stock class (reloaded by a plain
``from_pretrained``, with the pruned model's logits and greedy tokens, and read by the stock CTranslate2 converter);
plans they cannot hold are refused in one line, leaving no directory."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
import transformers

from gatedprune.deploy.formats import convert
from gatedprune.deploy.portable import FAMILIES
from gatedprune.shipping.export import sample_batch
from gatedprune.structures.adapters import probe
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.cut import count_parameters, prune_heads

BART_LIKE = ("bart", "mbart", "marian", "m2m_100")
STOCK_CLASS = transformers.models.auto.modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES


def _tokenizer(config) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer with one token per id of the model, its special tokens at the config's ids."""
    special = {getattr(config, "bos_token_id", None): "<s>", config.pad_token_id: "<pad>", config.eos_token_id: "</s>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(config.vocab_size)}
    unk = next(token for token in vocab if token.startswith("w"))
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bos = {"bos_token": "<s>"} if "<s>" in vocab else {}  # T5 has none: a new one would grow the vocabulary
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                                unk_token=unk, **bos)


def _sites(model, kind):
    return structure_sites(model, [kind])


def _portable_plan(model, family: str) -> dict:
    """A plan the stock class holds: per layer different FFN units but one width per stack (T5: one for both), a
    dropped layer; T5 also loses heads, the same ones in every self-attention layer of a stack (the decoder's other
    than the encoder's, cross-attention's different per layer: no bias ties them)."""
    t5 = family not in BART_LIKE
    plan = {site.path: list(range(site.layer, site.num_units, 2))[:15] for site in _sites(model, "encoder_ffn")}
    plan.update({site.path: list(range(site.layer, site.num_units, 2 if t5 else 3))[:15 if t5 else 10]
                 for site in _sites(model, "decoder_ffn")})
    if t5:
        plan.update({site.path: [1, 3] for site in _sites(model, "encoder")})
        plan.update({site.path: [0, 2] for site in _sites(model, "decoder")})
        plan.update({site.path: [[2, 3], [0, 1]][site.layer] for site in _sites(model, "cross")})
    # T5: the decoder's first layer, whose position bias table moves on; BART-likes: the encoder's first
    layers = probe(model).layers
    plan[layers["decoder" if t5 else "encoder"]] = [1]
    return plan


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    return model(**batch).logits


@torch.no_grad()
def _long_greedy(model, batch, steps: int = 8) -> torch.Tensor:
    """Greedy tokens with EOS held off for ``steps`` tokens: the cached decoding of every step is compared."""
    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                          num_beams=1, max_new_tokens=steps, min_new_tokens=steps, forced_eos_token_id=None)


def _stock_reload(out):
    config = json.loads((out / "config.json").read_text())
    assert "gatedprune" not in config and "auto_map" not in config
    assert not list(out.glob("*.py"))  # no modeling file beside the weights
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()  # no trust_remote_code
    assert type(again).__name__ == STOCK_CLASS[config["model_type"]]
    return again, config


@pytest.mark.parametrize("family", FAMILIES)
def test_an_expressible_plan_is_written_as_the_stock_class(model_of, family, tmp_path):
    model = model_of(family)
    dense = count_parameters(model)
    prune_heads(model, _portable_plan(model, family))
    out = tmp_path / "out"
    report = convert(model, out, "hf-portable", tokenizer=_tokenizer(model.config))
    assert report["verification"]["passed"]
    again, config = _stock_reload(out)
    assert count_parameters(again) < dense
    batch = sample_batch(model)
    assert (_logits(again, batch) - _logits(model, batch)).abs().max() < 1e-4
    assert torch.equal(_long_greedy(again, batch), _long_greedy(model, batch))
    # the counts the stock class was built with are the pruned modules' own shapes
    structure = probe(model)
    widths = {stack: {site.width for site in _sites(model, f"{stack}_ffn")} for stack in ("encoder", "decoder")}
    depth = {stack: len(model.get_submodule(path)) for stack, path in structure.layers.items()}
    if family in BART_LIKE:
        assert (config["encoder_ffn_dim"], config["decoder_ffn_dim"]) == (*widths["encoder"], *widths["decoder"])
        assert (config["encoder_layers"], config["decoder_layers"]) == (depth["encoder"], depth["decoder"])
        # what the stock CTranslate2 converter reads: pre-norm families end each stack with a layer norm
        assert config["normalize_before"] == hasattr(again.model.encoder, "layer_norm")
    else:
        assert {config["d_ff"]} == widths["encoder"] == widths["decoder"]
        assert (config["num_layers"], config["num_decoder_layers"]) == (depth["encoder"], depth["decoder"])
        assert config["num_heads"] == 2


@pytest.mark.parametrize("family", ["bart", "mbart"])  # the two whose converter takes normalize_before from the file
def test_the_stock_ctranslate2_converter_reads_a_portable_directory(model_of, family, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from ctranslate2.converters import TransformersConverter

    model = model_of(family)
    prune_heads(model, _portable_plan(model, family))
    tokenizer = _tokenizer(model.config)
    convert(model, tmp_path / "hf", "hf-portable", tokenizer=tokenizer)
    TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"))
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(4, model.config.vocab_size, (3, 9), generator=generator)  # (B, S): no special ids
    target = torch.randint(4, model.config.vocab_size, (3, 5), generator=generator)  # (B, T)
    start, eos = model.config.decoder_start_token_id, model.config.eos_token_id
    # mBART's converter leaves the start token to the caller (the target language code, for a real mBART)
    prefix = tokenizer.convert_ids_to_tokens([start]) if json.loads(
        (tmp_path / "ct2" / "config.json").read_text()).get("decoder_start_token") is None else []
    scored = translator.score_batch([tokenizer.convert_ids_to_tokens(row) for row in source.tolist()],
                                    [prefix + tokenizer.convert_ids_to_tokens(row) for row in target.tolist()])
    # the PyTorch model's log-probabilities of the same targets, then EOS
    decoder = torch.cat([torch.full((3, 1), start), target, torch.full((3, 1), eos)], dim=1)  # (B, 1 + T + 1)
    inputs = {"input_ids": source, "attention_mask": torch.ones_like(source)}
    log_probs = _logits(model, {**inputs, "decoder_input_ids": decoder[:, :-1]}).log_softmax(-1)
    expected = log_probs.gather(-1, decoder[:, 1:, None])[..., 0]  # (B, T + 1)
    assert (torch.tensor([s.log_probs for s in scored]) - expected).abs().max() < 1e-4
    steps = 8
    translated = translator.translate_batch(
        [tokenizer.convert_ids_to_tokens(row) for row in source.tolist()], target_prefix=[prefix] * 3 if prefix
        else None, beam_size=1, max_decoding_length=steps + len(prefix), min_decoding_length=steps + len(prefix))
    got = [tokenizer.convert_tokens_to_ids(t.hypotheses[0][len(prefix):]) for t in translated]
    assert got == _long_greedy(model, inputs, steps)[:, 1:].tolist()


def _uneven_ffn(model, stack: str) -> dict:
    return {site.path: list(range(37 if site.layer == 0 else 12)) for site in _sites(model, f"{stack}_ffn")}


def _stock_t5_generates(encoder_layers: int, decoder_layers: int) -> bool:
    """Whether the installed transformers' stock T5 generates with these depths (the reference for the refusal)."""
    config = transformers.T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=8, num_heads=2, num_layers=encoder_layers,
                                   num_decoder_layers=decoder_layers, decoder_start_token_id=0, eos_token_id=1)
    try:
        transformers.T5ForConditionalGeneration(config).eval().generate(input_ids=torch.tensor([[3, 4]]),
                                                                         max_new_tokens=2)
    except IndexError:
        return False
    return True


UNEVEN = {  # id: (family, plan of the model, words the one-line refusal says)
    "bart-ffn-by-layer": ("mbart", lambda m: _uneven_ffn(m, "decoder"),
                          ["decoder FFN widths differ by layer (37, 12)", "MBartConfig", "decoder_ffn_dim",
                           "pruning.uniform_ffn=true"]),
    "bart-heads-removed": ("bart", lambda m: {_sites(m, "cross")[1].path: [0, 1, 3]},
                           ["heads were removed", "cross-attention of layer 1", "3 of 4", "head_dim"]),
    "bart-empty-ffn": ("m2m_100", lambda m: {_sites(m, "encoder_ffn")[0].path: []}, ["no units left", "layer 0"]),
    "t5-head-counts": ("t5", lambda m: {_sites(m, "cross")[0].path: [0, 1, 2]},
                       ["head counts differ", "cross-attention 3, 4)", "one num_heads"]),
    "t5-head-indices": ("t5", lambda m: {s.path: [[0, 1], [0, 2]][s.layer] if s.kind == "encoder" else [0, 1]
                                         for s in structure_sites(m, ["encoder", "decoder", "cross"])},
                        ["encoder self-attention layers keep different heads", "[0, 1] in layer 0",
                         "[0, 2] in layer 1", "position bias"]),
    "t5-empty-heads": ("t5", lambda m: {_sites(m, "decoder")[1].path: []}, ["no heads left", "layer 1"]),
    "mt5-ffn-between-stacks": ("mt5", lambda m: {s.path: list(range(10)) for s in _sites(m, "encoder_ffn")},
                               ["FFN widths differ between the stacks", "encoder 10", "decoder 48", "one d_ff"]),
}


@pytest.mark.parametrize("case", UNEVEN)
def test_a_plan_the_stock_class_cannot_hold_is_refused_in_one_line(model_of, case, tmp_path):
    family, plan_of, words = UNEVEN[case]
    model = model_of(family)
    prune_heads(model, plan_of(model))
    with pytest.raises(ValueError) as refused:
        convert(model, tmp_path / "out", "hf-portable")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("hf-portable: ")
    assert all(word in message for word in words), message
    assert list(tmp_path.iterdir()) == []  # no directory, no staged leftovers


def test_a_t5_decoder_deeper_than_its_encoder_converts_and_the_stock_class_generates(model_of, tmp_path):
    """The stock T5 of transformers 5.24 sizes its generation cache by the encoder's depth; surgery gives the
    config ``decoder_layers`` (which the decoder view reads), so the stock class generates from what we write."""
    model = model_of("t5")
    prune_heads(model, {probe(model).layers["encoder"]: [1]})  # encoder 1 layer, decoder 2
    assert convert(model, tmp_path / "out", "hf-portable")["verification"]["passed"]
    again, config = _stock_reload(tmp_path / "out")
    assert config["num_layers"] == 1 and config["num_decoder_layers"] == config["decoder_layers"] == 2
    assert again.generate(input_ids=torch.tensor([[5, 6, 7, 1]]), max_new_tokens=4, min_new_tokens=4).shape[1] == 5


def test_a_config_whose_cache_misses_decoder_layers_is_refused(model_of, tmp_path):
    """A stock T5 directory given those depths directly (no ``decoder_layers``): refused where generate() fails."""
    model = model_of("t5")
    prune_heads(model, {probe(model).layers["encoder"]: [1]})
    del model.config.decoder_layers
    if _stock_t5_generates(1, 2):
        pytest.skip("this transformers sizes the T5 cache by the decoder")
    with pytest.raises(ValueError, match=r"^hf-portable: the decoder keeps 2 layers .* generation cache to 1 \(its num_layers\)"):
        convert(model, tmp_path / "out", "hf-portable")
    assert list(tmp_path.iterdir()) == []


def test_a_dense_model_converts_unchanged(model_of, tmp_path):
    model = model_of("marian")
    report = convert(model, tmp_path / "out", "hf-portable")
    again, config = _stock_reload(tmp_path / "out")
    assert report["verification"]["passed"] and count_parameters(again) == count_parameters(model)
    batch = sample_batch(model)
    assert torch.equal(_logits(again, batch), _logits(model, batch))
    assert all(config[field] == getattr(model.config, field) for field in
               ("encoder_layers", "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim", "encoder_attention_heads"))
