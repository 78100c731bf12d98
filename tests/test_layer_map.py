"""Layer distillation through a layer map (pruning.distill.layer_map=nearest, gatedprune.training.layer_map): the
match and the loss against their formulas, on students without some layers and on every family; the maps train with
the model, stay out of the export and fit checkpoints written without them; the options and the lifted refusal."""

import pytest
import torch

from gatedprune.training.distill import DistillOptions, kl_distillation

def _deep_bart(tmp_path, layers: int = 3):
    """A tiny random BART of ``layers`` encoder and decoder layers (the families' tiny ones have 2)."""
    import transformers

    from families import FAMILY_CONFIGS

    torch.manual_seed(0)
    config = FAMILY_CONFIGS["bart"]()
    config.encoder_layers = config.decoder_layers = layers
    return transformers.BartForConditionalGeneration(config).eval()


def _batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (2, 6), generator=generator)  # (B, S)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0
    labels = torch.randint(3, 97, (2, 5), generator=generator)  # (B, T)
    labels[0, 3:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def test_nearest_alignment_keeps_the_order_of_layers():
    from gatedprune.training.layer_map import nearest_alignment

    errors = torch.tensor([[0.4, 0.1, 0.9],   # teacher layer 0: student layer 1 is closest
                           [0.0, 0.5, 0.3],   # layer 0 is closer still, but before the match: the best of 1..2 is 2
                           [0.2, 0.2, 0.2]])  # only layer 2 is at or after the previous match
    expected, start = [], 0
    for row in errors.tolist():  # the definition: argmin over j >= the previous match, the first of equals
        start = min(range(start, len(row)), key=lambda j: (row[j], j))
        expected.append(start)
    assert nearest_alignment(errors) == expected == [1, 2, 2]
    assert nearest_alignment(torch.tensor([[0.5, 0.5], [0.5, 0.5]])) == [0, 0]  # ties go to the earlier layer


@pytest.mark.parametrize("kept_encoder", [[0, 2], []])
def test_the_layer_map_loss_of_a_student_without_some_layers_against_its_formula(tmp_path, kept_encoder):
    """distilled_loss with layer_map=nearest on a student that lost encoder layer 1 (or all of them) and decoder
    layers 0 and 2, through maps that are not the identity, against the formula computed here from the two models'
    hidden states: MSE per element over real tokens, the match argmin over student layers at or after the previous
    one, the sum over teacher layers of both stacks. An encoder without layers offers its output."""
    import copy

    import torch.nn.functional as F

    from gatedprune.surgery.cut import prune_heads
    from gatedprune.training.distill import distilled_loss
    from gatedprune.training.layer_map import LayerMaps

    teacher = _deep_bart(tmp_path)
    student = prune_heads(copy.deepcopy(teacher), {"model.encoder.layers": kept_encoder, "model.decoder.layers": [1]})
    with torch.no_grad():  # the student moved away from the teacher, so the distances differ between layers
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    student.train()
    maps = LayerMaps.for_model(teacher)
    with torch.no_grad():
        for linear in maps.values():
            linear.weight.add_(0.1 * torch.randn_like(linear.weight))
            linear.bias.add_(0.1 * torch.randn_like(linear.bias))
    batch = _batch()
    options = DistillOptions(alpha=0.3, temperature=2.0, hidden=0.7, layer_map="nearest")
    ce, loss, logs = distilled_loss(student, teacher, batch, options, label_smoothing=0.1, maps=maps)
    loss.backward()

    decoder_input_ids = student.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  decoder_input_ids=decoder_input_ids, output_hidden_states=True)
    with torch.no_grad():
        s, t = student(**inputs), teacher(**inputs)
    masks = {"encoder": batch["attention_mask"].bool(), "decoder": batch["labels"] != -100}

    def mse(linear, mask, h_s, h_t):  # per element, over the real tokens, with the map applied to the student
        W, b = linear.weight.detach(), linear.bias.detach()
        cells = [((W @ h_s[i, j] + b - h_t[i, j]) ** 2).sum().item()
                 for i in range(h_s.shape[0]) for j in range(h_s.shape[1]) if mask[i, j]]
        return sum(cells) / (len(cells) * h_s.shape[-1])

    hidden, matches = 0.0, {}
    for stack in ("encoder", "decoder"):
        ours, theirs = getattr(s, f"{stack}_hidden_states")[1:], getattr(t, f"{stack}_hidden_states")[1:]
        ours = ours or (s.encoder_last_hidden_state,)  # no encoder layers: the embeddings, as the encoder outputs them
        previous, matches[stack] = 0, []
        for h_t in theirs:
            distances = {j: mse(maps[stack], masks[stack], ours[j], h_t) for j in range(previous, len(ours))}
            previous = min(distances, key=lambda j: (distances[j], j))
            matches[stack].append(previous)
            hidden += distances[previous]
    assert len(matches["encoder"]) == 3 and max(matches["decoder"]) == 0  # 3 teacher layers, 1 student decoder layer
    expected_ce = F.cross_entropy(s.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                  label_smoothing=0.1)
    expected_kd = kl_distillation(s.logits, t.logits, batch["labels"], 2.0)
    assert logs["distill_hidden"].item() == pytest.approx(hidden, rel=1e-4) and hidden > 0
    assert ce.item() == pytest.approx(expected_ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx((0.7 * expected_ce + 0.3 * expected_kd + 0.7 * hidden).item(), rel=1e-4)
    assert all(linear.weight.grad.abs().sum() > 0 for linear in maps.values())  # the maps learn from the loss
    assert all(p.grad is None for p in teacher.parameters())


def test_same_layer_map_refuses_a_student_with_fewer_layers(tmp_path):
    import copy

    from gatedprune.surgery.cut import prune_heads
    from gatedprune.training.distill import distilled_loss

    teacher = _deep_bart(tmp_path)
    student = prune_heads(copy.deepcopy(teacher), {"model.encoder.layers": [0, 2]})
    with pytest.raises(ValueError, match="the student has 2 encoder layers, the teacher 3; allowed: "
                                         "pruning.distill.layer_map=nearest"):
        distilled_loss(student, teacher, _batch(), DistillOptions(hidden=1.0), label_smoothing=0.0)


def test_layer_map_options_are_checked_and_lift_the_refusal_of_layer_kinds():
    from gatedprune.methods.gated import L0
    from gatedprune.structures.kinds import ALL_KINDS

    with pytest.raises(ValueError) as refused:
        DistillOptions(hidden=1.0, layer_map="closest")
    assert str(refused.value) == "pruning.distill.layer_map='closest'; allowed: same, nearest"
    with pytest.raises(ValueError) as refused:  # today's behaviour, the default, has no map to drop layers with
        L0(kinds=ALL_KINDS, distill=DistillOptions(hidden=1.0))
    assert "allowed: pruning.distill.layer_map=nearest" in str(refused.value) and "\n" not in str(refused.value)
    method = L0(kinds=ALL_KINDS, distill={"hidden": 1.0, "layer_map": "nearest"})  # as a config file gives it
    assert method.distill.maps_layers and not DistillOptions(hidden=1.0).maps_layers


def _mapped_module(tmp_path, layer_map: str = "nearest", hidden: float = 1.0):
    """A GatedSeq2Seq gating every kind of a tiny mBART from step 0, distilling its hidden states by ``layer_map``."""
    import tokenizers
    import transformers

    from families import tiny_model
    from gatedprune.methods.gated import L0
    from gatedprune.reports.scoring import GenerationConfig
    from gatedprune.structures.kinds import ALL_KINDS
    from gatedprune.training.module import GatedSeq2Seq, OptimConfig

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 1, "<unk>": 0}, "<unk>")),
        pad_token="<pad>",
    )
    method = L0(kinds=ALL_KINDS, distill=DistillOptions(hidden=hidden, layer_map=layer_map))
    module = GatedSeq2Seq(tiny_model("mbart", tmp_path), tokenizer, method, OptimConfig(), GenerationConfig(), tmp_path)
    module.log = module.log_dict = lambda *args, **kwargs: None  # outside a Trainer
    return module


def test_the_layer_maps_train_with_the_model_and_stay_out_of_the_export(tmp_path):
    from safetensors.torch import load_file

    from gatedprune.shipping.export import export_gated

    module = _mapped_module(tmp_path)
    assert module.teacher is not None and module._teacher_ready is False
    module.on_train_batch_start(_batch(), 0)  # the first gated step: the teacher takes the dense weights
    assert module._teacher_ready
    with torch.no_grad():  # as after some gated steps: the student moved, so the matched layers differ
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = {k: v.clamp(max=90) for k, v in _batch().items()}
    batch["labels"][0, 3:] = -100
    loss = module.training_step(batch, 0)
    loss.backward()
    maps = list(module.layer_maps.parameters())
    assert maps and all(p.grad is not None and p.grad.abs().sum() > 0 for p in maps)
    optimizer = module.configure_optimizers()["optimizer"]
    model_group = optimizer.param_groups[0]["params"]
    assert model_group[-len(maps):] == maps and len(model_group) == len(list(module.model.parameters())) + len(maps)
    out = tmp_path / "export"
    export_gated(module.model, module.gates, out)
    saved = load_file(out / "model.safetensors")
    assert not any("layer_map" in key for key in saved) and set(saved) <= set(module.model.state_dict())


def test_a_checkpoint_without_layer_maps_fits_a_run_with_them_and_back(tmp_path):
    """A fork from a dense.ckpt written without maps: identity maps with fresh optimiser state, and every other
    parameter's state where it was; a checkpoint with maps read by a run without them loses them alike."""
    from gatedprune.training.layer_map import fit_checkpoint

    def stepped(module):  # one optimiser step, so every trained parameter has state
        optimizer = module.configure_optimizers()["optimizer"]
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            p.grad = torch.ones_like(p)
        optimizer.step()
        return optimizer

    plain, mapped = _mapped_module(tmp_path / "a", hidden=0.0), _mapped_module(tmp_path / "b")
    for source, target in ((plain, mapped), (mapped, plain)):
        checkpoint = {"state_dict": dict(source.state_dict()), "optimizer_states": [stepped(source).state_dict()]}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("teacher.")}
        fit_checkpoint(checkpoint, target.layer_maps)
        state = {k: v for k, v in target.state_dict().items() if not k.startswith("teacher.")}
        assert set(checkpoint["state_dict"]) == set(state)
        optimizer = target.configure_optimizers()["optimizer"]
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # the groups' sizes match
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:  # every parameter's saved state is its own (the gates' after the maps included)
            if p in optimizer.state:
                assert optimizer.state[p]["exp_avg"].shape == p.shape
        if target.layer_maps is not None:
            assert all(p not in optimizer.state for p in target.layer_maps.parameters())
            d = target.model.config.d_model
            assert torch.equal(checkpoint["state_dict"]["layer_maps.encoder.weight"], torch.eye(d))
        assert sum(p in optimizer.state for p in params) == len(params) - (4 if target.layer_maps is not None else 0)


def test_the_layer_map_of_every_family(family, model_of):
    """Each family's hidden states through the map: a student equal to its teacher matches layer t to layer t at no
    cost; one without its first layer of each stack gets a positive loss whose gradient reaches the maps."""
    import copy

    from gatedprune.structures.adapters import probe
    from gatedprune.surgery.cut import prune_heads
    from gatedprune.training.layer_map import LayerMaps, mapped_layer_distillation
    from gatedprune.reports.scoring import teacher_forced_inputs

    teacher = model_of(family)
    batch = {k: v.clamp(max=teacher.config.vocab_size - 1) for k, v in _batch().items()}
    batch["labels"][0, 3:] = -100
    masks = (batch["attention_mask"], batch["labels"] != -100)
    inputs = {**teacher_forced_inputs(teacher, batch), "output_hidden_states": True}
    maps = LayerMaps.for_model(teacher)
    with torch.no_grad():
        reference = teacher(**inputs)
    loss, alignment = mapped_layer_distillation(reference, reference, maps, *masks)
    layers = {stack: len(getattr(reference, f"{stack}_hidden_states")) - 1 for stack in ("encoder", "decoder")}
    assert loss.item() == 0.0 and alignment == {stack: list(range(n)) for stack, n in layers.items()}
    stacks = probe(teacher).layers
    student = prune_heads(copy.deepcopy(teacher), {stacks[s]: list(range(1, n)) for s, n in layers.items()})
    loss, alignment = mapped_layer_distillation(student(**inputs), reference, maps, *masks)
    loss.backward()
    assert loss.item() > 0 and all(len(alignment[s]) == n for s, n in layers.items())
    assert all(linear.weight.grad.abs().sum() > 0 for linear in maps.values())
