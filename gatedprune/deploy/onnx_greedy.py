"""Greedy decoding of a gatedprune ONNX export with ONNX Runtime alone (numpy and onnxruntime; no torch, no
transformers).

The directory ``--format onnx`` writes holds two graphs and the file that says how to drive them
(``onnx_config.json``):

- ``encoder.onnx``: ``input_ids``, ``attention_mask`` (B, S) -> ``last_hidden_state`` (B, S, d) and, for every
  decoder layer i, the keys and values its cross-attention reads, ``past_key_values.{i}.encoder.key|value``
  (B, H_i, S, D_i): computed once per source, as the decoder would on its first step.
- ``decoder_step.onnx``: one decoder token. ``input_ids`` (B, 1), ``encoder_attention_mask`` (B, S), the cross
  keys and values above, and the self-attention cache of every layer ``past_key_values.{i}.decoder.key|value``
  (B, H_i, T, D_i), in the order (self key, self value, cross key, cross value) per layer -> ``logits`` (B, 1, V)
  of that token and ``present.{i}.decoder.key|value`` (B, H_i, T + 1, D_i), the caches to feed back. The first
  step feeds caches of length T = 0. Heads and head sizes are per layer (a pruned model keeps different heads in
  each; a layer left without heads keeps one head of zeros), so the config lists the shape of every cache.

This file travels in the directory too (``onnx_greedy.py``): it needs numpy and onnxruntime only, not gatedprune.

Use::

    from gatedprune.deploy.onnx_greedy import OnnxSeq2Seq
    model = OnnxSeq2Seq("out/onnx")
    ids = tokenizer(["Hello world"])["input_ids"]          # the tokenizer files travel in the directory
    print(tokenizer.batch_decode(model.greedy(ids, max_new_tokens=64), skip_special_tokens=True))
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG_FILE = "onnx_config.json"
ENCODER_FILE = "encoder.onnx"
STEP_FILE = "decoder_step.onnx"


def cache_name(layer: int, part: str, kind: str, prefix: str = "past_key_values") -> str:
    """The graph name of a cache tensor: ``past_key_values.{layer}.{decoder|encoder}.{key|value}`` going in,
    ``present.{layer}.decoder.{key|value}`` coming out (the names optimum's seq2seq exports use)."""
    return f"{prefix}.{layer}.{part}.{kind}"


class OnnxSeq2Seq:
    """The two graphs of an export directory in ONNX Runtime sessions, and the greedy loop over them.

    ``threads``: ONNX Runtime's intra-op threads (None: its default, every core). ``providers``: its execution
    providers, CPU by default.
    """

    def __init__(self, directory: str | Path, threads: int | None = None,
                 providers: tuple[str, ...] = ("CPUExecutionProvider",)):
        import onnxruntime

        directory = Path(directory)
        self.config = json.loads((directory / CONFIG_FILE).read_text())
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: the graph optimizer's notes are not the user's business
        options.inter_op_num_threads = 1
        if threads is not None:
            options.intra_op_num_threads = threads
        session = lambda name: onnxruntime.InferenceSession(  # noqa: E731
            str(directory / self.config[name]["file"]), options, providers=list(providers))
        self.encoder, self.decoder = session("encoder"), session("decoder_step")
        tokens = self.config["tokens"]
        self.start, self.eos = tokens["decoder_start"], list(tokens["eos"])
        self.pad, self.forced_first = tokens["pad"], tokens["forced_first"]
        self.caches = self.config["decoder_step"]["caches"]  # [{"input", "output", "heads", "head_dim"}]
        self.cross_names = self.config["encoder"]["cross_outputs"]

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        """The cross-attention keys and values (B, H_i, S, D_i) of every decoder layer, by step-input name."""
        feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)}
        return dict(zip(self.cross_names, self.encoder.run(self.cross_names, feeds)))

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One decoder token: its logits (B, V) and the grown self-attention caches, in ``caches`` order."""
        outputs = self.decoder.run(["logits"] + [c["output"] for c in self.caches], feeds)
        return outputs[0][:, -1], outputs[1:]

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int,
                 stop_at_eos: bool = True, on_step=None) -> np.ndarray:
        """Greedy tokens (B, N) of a padded batch, N <= ``max_new_tokens`` (the forced first token counted), EOS
        and what follows it included. All rows step together; ``stop_at_eos`` stops once every row has emitted EOS
        (False: always N steps). ``on_step(step, fed, logits)``, if given, sees every step: the ids fed (B,) and
        the logits they gave (B, V)."""
        batch = input_ids.shape[0]
        mask = attention_mask.astype(np.int64)
        feeds = self.encode(input_ids, mask)
        feeds["encoder_attention_mask"] = mask
        for cache in self.caches:  # the first step: every cache of length 0
            feeds[cache["input"]] = np.zeros((batch, cache["heads"], 0, cache["head_dim"]), np.float32)
        token = np.full((batch,), self.start, np.int64)
        done = np.zeros(batch, bool)
        tokens = []
        for t in range(max_new_tokens):
            feeds["input_ids"] = token[:, None]  # (B, 1)
            logits, grown = self.step(feeds)
            feeds.update({cache["input"]: array for cache, array in zip(self.caches, grown)})
            if on_step is not None:
                on_step(t, token, logits)
            token = logits.argmax(-1).astype(np.int64)  # the first maximum on ties, as torch.argmax
            if t == 0 and self.forced_first is not None:
                token[:] = self.forced_first
            tokens.append(token)
            done |= np.isin(token, self.eos)
            if stop_at_eos and done.all():
                break
        return np.stack(tokens, 1) if tokens else np.zeros((batch, 0), np.int64)

    def until_eos(self, row) -> list[int]:
        """The generated ids before the first EOS."""
        row = [int(t) for t in row]
        return row[: next((i for i, t in enumerate(row) if t in self.eos), len(row))]

    def greedy(self, source_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy ids of each source (lists of token ids, EOS included as the tokenizer adds it), generated tokens
        only, up to the first EOS; the sources are padded on the right into one batch."""
        if not source_ids:
            return []
        length = max(len(ids) for ids in source_ids)
        pad = 0 if self.pad is None else self.pad  # masked out either way
        input_ids = np.full((len(source_ids), length), pad, np.int64)  # (B, S)
        attention_mask = np.zeros((len(source_ids), length), np.int64)
        for row, ids in enumerate(source_ids):
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        return [self.until_eos(row) for row in self.generate(input_ids, attention_mask, max_new_tokens)]
