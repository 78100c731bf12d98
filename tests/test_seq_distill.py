"""Sequence-level distillation (finetune.targets=dense_greedy): the targets are the dense model's greedy translations
(against a reference decode, one sentence at a time), cached once and reused, made anew for another teacher; the
training batches swap to them and back; bad values are refused in one line; one train.py run with every new option."""

import json

import pytest
import torch
import transformers

from families import save_plain_mbart
from helpers import compose_train

from gatedprune.data.datamodule import FilesData
from gatedprune.shipping.finetune import FineTuneConfig
from gatedprune.training import seq_distill
from gatedprune.training.seq_distill import cache_path, sequence_targets

WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "big", "red", "ran", "home", "fast"]
MOTS = ["le", "chat", "chien", "assis", "sur", "un", "tapis", "grand", "rouge", "courut", "maison", "vite"]
MAX_LENGTH = 24


@pytest.fixture(scope="module")
def data_and_teacher(tmp_path_factory):
    """A files data module of 30 short synthetic pairs (set up) and a tiny random mBART sized to its tokenizer that
    does not stop at once (at least 4 new tokens), so the targets are sentences."""
    root = tmp_path_factory.mktemp("seqkd")
    generator = torch.Generator().manual_seed(0)
    lines = {}
    for split, count in (("train", 30), ("validation", 4)):
        rows = []
        for _ in range(count):
            picks = torch.randint(0, len(WORDS), (int(torch.randint(2, 6, (1,), generator=generator)),),
                                  generator=generator).tolist()
            rows.append(" ".join(WORDS[i] for i in picks) + "\t" + " ".join(MOTS[i] for i in picks))
        (root / f"{split}.tsv").write_text("\n".join(rows) + "\n")
        lines[split] = rows
    dm = FilesData(files={s: str(root / f"{s}.tsv") for s in lines}, files_header=False, vocab_size=60,
                   tokenizer_dir=str(root / "tokenizer"), max_tokens=96, max_length=MAX_LENGTH, eval_batch_size=7)
    dm.setup()
    save_plain_mbart(root / "teacher", dm.tokenizer, width=16)
    teacher = transformers.AutoModelForSeq2SeqLM.from_pretrained(root / "teacher").eval()
    teacher.generation_config.min_new_tokens = 4
    return dm, teacher


def _reference_greedy(model, tokenizer, src_ids) -> list[str]:
    """Greedy decoding of one source at a time, no padding: what the batched targets must equal."""
    texts = []
    for ids in src_ids:
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             num_beams=1, do_sample=False, max_new_tokens=MAX_LENGTH)
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return texts


def test_the_targets_are_the_dense_models_greedy_translations_cached_once(data_and_teacher, tmp_path, monkeypatch):
    dm, teacher = data_and_teacher
    dataset = dm.datasets["train"]
    texts = sequence_targets(teacher, dm, tmp_path / "cache")
    assert texts == _reference_greedy(teacher, dm.tokenizer, dataset.src_ids)
    assert max(len(dm.tokenizer(text_target=t)["input_ids"]) for t in texts) > 4  # sentences, not an EOS alone
    path = cache_path(teacher, dm, tmp_path / "cache")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["source"], r["target"]) for r in rows] == [(s, t) for (s, _), t in zip(dataset.pairs, texts)]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # written through a rename: no temporary left

    def must_not_generate(*args, **kwargs):
        raise AssertionError("the cached targets were generated again")

    monkeypatch.setattr(seq_distill, "translations", must_not_generate)
    assert sequence_targets(teacher, dm, tmp_path / "cache") == texts  # a relaunch reads them back


def test_another_teacher_or_a_damaged_cache_makes_the_targets_again(data_and_teacher, tmp_path, monkeypatch):
    import copy

    dm, teacher = data_and_teacher
    calls = []

    def counted(model, tokenizer, src_ids, batch_size, max_new_tokens, num_beams=1):
        calls.append(model)
        return [f"t{i}" for i in range(len(src_ids))]

    monkeypatch.setattr(seq_distill, "translations", counted)
    first = sequence_targets(teacher, dm, tmp_path)
    other = copy.deepcopy(teacher)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    assert cache_path(other, dm, tmp_path) != cache_path(teacher, dm, tmp_path)
    assert sequence_targets(other, dm, tmp_path) == first and len(calls) == 2  # another key: generated again
    cache_path(teacher, dm, tmp_path).write_text('{"source": "cut sho')  # a half line: not this run's targets
    sequence_targets(teacher, dm, tmp_path)
    assert len(calls) == 3 and len(cache_path(teacher, dm, tmp_path).read_text().splitlines()) == len(first)


def test_the_training_split_swaps_to_the_targets_and_back(data_and_teacher):
    dm, _ = data_and_teacher
    references, batches, validation = dm.datasets["train"], dm.batches["train"], dm.datasets["validation"]
    texts = [" ".join(["chat"] * (2 * i)) for i in range(len(references))]  # the longest cut to max_length
    dm.set_train_targets(texts)
    swapped = dm.datasets["train"]
    expected = dm.tokenizer(text_target=texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    assert swapped.tgt_ids == expected and swapped.src_ids == references.src_ids
    assert max(map(len, swapped.tgt_ids)) == MAX_LENGTH
    order = sorted(i for batch in dm.batches["train"] for i in batch)
    assert order == list(range(len(texts)))  # every pair once, each batch within the token budget
    for batch in dm.batches["train"]:
        assert len(batch) * max(max(len(swapped.src_ids[i]), len(swapped.tgt_ids[i])) for i in batch) <= dm.max_tokens
    labels = next(iter(dm.loader("train")))["labels"]
    assert any(row[row != -100].tolist() in expected for row in labels)
    assert dm.datasets["validation"] is validation  # validation keeps its references
    with pytest.raises(ValueError, match=f"0 training targets for {len(references)} training pairs"):
        dm.set_train_targets([])
    dm.set_train_targets(None)
    assert dm.datasets["train"] is references and dm.batches["train"] is batches


def test_the_dense_model_of_a_run(tmp_path, monkeypatch):
    from helpers import gated_module

    from gatedprune.methods.gated import L0
    from gatedprune.shipping.export import ExportConfig
    from gatedprune.training.module import GatedSeq2Seq
    from gatedprune.training.seq_distill import dense_model

    module = gated_module(tmp_path)  # no teacher, no gated step: its model is the dense model, without the gates
    dense = dense_model(module)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in dense.modules())
    assert all(torch.equal(a, b) for a, b in zip(dense.state_dict().values(), module.model.state_dict().values()))
    monkeypatch.setattr(GatedSeq2Seq, "gates_trained", property(lambda self: True))  # trained on, no copy kept
    with pytest.raises(ValueError, match="no copy of them was kept"):
        dense_model(module)
    # a gated run that fine-tunes on the targets keeps the dense weights though nothing distils
    method = L0()
    method.check_outputs(ExportConfig(out_dir=str(tmp_path / "pruned")),
                         FineTuneConfig(targets="dense_greedy", out_dir=str(tmp_path / "tuned")), tmp_path)
    assert method.keeps_dense and not method.distill.on
    kept = GatedSeq2Seq(module.model, module.tokenizer, method, module.optim, module.generation, tmp_path)
    assert kept.teacher is not None and kept.layer_maps is None


def test_bad_targets_are_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        FineTuneConfig(targets="teacher")
    assert str(refused.value) == ("finetune.targets='teacher'; allowed: labels, dense_greedy, dense_beam, both_greedy, "
                                  "both_beam")
    with pytest.raises(ValueError, match="finetune.targets_max=5 with finetune.targets=labels; allowed"):
        FineTuneConfig(targets_max=5)
    with pytest.raises(ValueError, match="finetune.targets_max=0 with finetune.targets=dense_beam; allowed"):
        FineTuneConfig(targets="dense_beam", targets_max=0)
    for alpha in (0, 1.5):
        with pytest.raises(ValueError, match=f"finetune.distill_alpha={alpha}; allowed: 0 < alpha <= 1"):
            FineTuneConfig(distill_alpha=alpha)


def _reference_beam(model, tokenizer, src_ids, beams: int) -> list[str]:
    """Beam search over one source at a time, no padding."""
    texts = []
    for ids in src_ids:
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             num_beams=beams, do_sample=False, max_new_tokens=MAX_LENGTH)
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return texts


def test_beam_targets_of_the_first_n_sources_beside_the_references(data_and_teacher, tmp_path):
    from gatedprune.training.seq_distill import BEAM, TARGETS

    dm, teacher = data_and_teacher
    references = dm.datasets["train"]
    kind = TARGETS["both_beam"]
    assert (kind.num_beams, kind.references) == (BEAM, True) == (4, True)
    texts = sequence_targets(teacher, dm, tmp_path, num_beams=BEAM, limit=7)
    assert texts == _reference_beam(teacher, dm.tokenizer, references.src_ids[:7], BEAM)
    assert texts != _reference_greedy(teacher, dm.tokenizer, references.src_ids[:7])  # beam search chose others
    # cached apart from the greedy targets of all sources, one line per translated source
    path = cache_path(teacher, dm, tmp_path, BEAM, 7)
    assert path != cache_path(teacher, dm, tmp_path) and len(path.read_text().splitlines()) == 7
    dm.set_train_targets(texts, keep_references=True)
    both = dm.datasets["train"]
    assert both.pairs == list(references.pairs) + [(s, t) for (s, _), t in zip(references.pairs[:7], texts)]
    assert both.src_ids == list(references.src_ids) + list(references.src_ids[:7])
    assert sorted(i for batch in dm.batches["train"] for i in batch) == list(range(len(references) + 7))
    dm.set_train_targets(texts)  # the translations alone: the first 7 sources
    assert dm.datasets["train"].pairs == [(s, t) for (s, _), t in zip(references.pairs[:7], texts)]
    dm.set_train_targets(None)
    assert dm.datasets["train"] is references


def test_a_run_with_layer_kinds_maps_layers_and_fine_tunes_on_the_dense_models_translations(tmp_path):
    """One smoke run with every new option: layer kinds distilled through the layer map while gating and while
    fine-tuning the export, on the dense model's greedy translations (cached in the run directory)."""
    from gatedprune.structures.kinds import ALL_KINDS
    from gatedprune.train import train

    run = tmp_path / "run"
    metrics = train(compose_train(run, "experiment=smoke", f"pruning.kinds=[{','.join(ALL_KINDS)}]",
                                  "pruning.distill.alpha=0.5", "pruning.distill.hidden=1.0",
                                  "pruning.distill.layer_map=nearest", "finetune.steps=4", "finetune.distill=true",
                                  "finetune.targets=dense_greedy", "data.max_train_pairs=60",
                                  "pruning.l0_lambda=20", "pruning.gate_lr=0.5", "trainer.max_steps=40"))
    assert metrics["finetune"]["steps"] == 4
    from safetensors.torch import load_file

    from gatedprune import load_pruned

    shipped = load_pruned(run / "pruned_finetuned")
    assert shipped.config.encoder_layers + shipped.config.decoder_layers < 4  # the map met fewer student layers
    assert not any("layer_map" in key for key in load_file(run / "pruned_finetuned" / "model.safetensors"))
    caches = list((run / "cache").glob("seqkd-*.jsonl"))
    assert len(caches) == 1 and len(caches[0].read_text().splitlines()) == 60
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert {k for k in last if k.startswith("layer_maps.")} == {f"layer_maps.{s}.{p}" for s in ("encoder", "decoder")
                                                               for p in ("weight", "bias")}
    assert not torch.equal(last["layer_maps.encoder.weight"], torch.eye(last["layer_maps.encoder.weight"].shape[0]))
    import csv

    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/distill_hidden")]
    assert rows and all(float(r["train/distill_hidden"]) >= 0 for r in rows)


def test_a_fine_tune_distils_with_its_own_weight_on_capped_targets_beside_the_references(tmp_path, monkeypatch):
    """finetune.distill_alpha distils in the fine-tune alone (the gated phase's alpha stays 0), on both_greedy
    targets of the first 10 sources: the distillation term is computed at every fine-tuning step with that alpha."""
    from gatedprune.shipping import finetune as finetune_module
    from gatedprune.train import train

    seen = []
    real = finetune_module.distilled_loss

    def counted(student, teacher, batch, options, *args, **kwargs):
        seen.append((options.alpha, teacher is not None, len(batch["labels"])))
        return real(student, teacher, batch, options, *args, **kwargs)

    monkeypatch.setattr(finetune_module, "distilled_loss", counted)
    run = tmp_path / "run"
    metrics = train(compose_train(run, "experiment=smoke", "finetune.steps=3", "finetune.distill_alpha=0.5",
                                  "finetune.targets=both_greedy", "finetune.targets_max=10", "data.max_train_pairs=30"))
    tuned = metrics["finetune"]
    assert (tuned["distill_alpha"], tuned["targets"], tuned["targets_max"]) == (0.5, "both_greedy", 10)
    assert metrics["distill"]["alpha"] == 0  # the gated phase did not distil
    assert len(seen) == 3 and all(alpha == 0.5 and has_teacher for alpha, has_teacher, _ in seen)
    caches = list((run / "cache").glob("seqkd-*.jsonl"))
    assert len(caches) == 1 and len(caches[0].read_text().splitlines()) == 10
