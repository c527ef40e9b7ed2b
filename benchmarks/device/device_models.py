"""The device benchmark's model, tokenizer and workloads (see `benchmarks/device/device_bench.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

# hidden 2048, 16 layers, MLP 8192, 32/8 heads, 32,000 tied vocabulary: 1.04B parameters, the
# size of the measurements.
MODEL_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True)
MODEL_TINY = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
# 32k: the agent trace (benchmarks/agent/agent_trace.py) is ~21k tokens with these random BPE tokenizers and the
# side-by-side multi-turn part passes 4,096 by its last turns (random replies re-tokenize longer).
CONTEXT = 32768
# BOS, EOS, then ChatML's turn markers as special tokens, as every chat checkpoint has them (SmolLM2's
# ids 1 and 2): the served models' template is ChatML, and a marker spelled out in bytes would make
# every prompt a run of plain text, which no real chat tokenizer gives a server (Pomona encodes an
# agent's resent conversation only past the last turn marker it has seen: api/core/prompt_tokens.py).
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")


def build_model(shape: dict, dtype: mx.Dtype, seed: int) -> tuple[Any, int]:
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": CONTEXT, **shape,
    })
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, params


def _bpe_vocab(vocab_size: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """256 byte symbols, then merges that grow short tokens one letter at a time."""
    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    letters = [c for c in alphabet if c.isascii() and c.isalpha()] + ["Ġ"] * 6  # "Ġ" is the space byte
    vocab = {c: i for i, c in enumerate(alphabet)}
    growable = list(alphabet)
    merges = []
    while len(vocab) < vocab_size - len(SPECIALS):
        a, b = rng.choice(growable), rng.choice(letters)
        if a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        if len(a) < 7:
            growable.append(a + b)
    return vocab, merges


def build_tokenizer(vocab_size: int, seed: int, folder: Path) -> Any:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, loaded the way mlx-lm loads one.

    The specials (BOS, EOS, the ChatML markers) take the last ids, like Llama 3's layout. `mlx_lm.tokenizer_utils.load` sees
    the ByteLevel decoder and picks `BPEStreamingDetokenizer`, the detokenizer Llama 3 and Qwen
    checkpoints get.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _bpe_vocab(vocab_size, seed)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
        "model_max_length": CONTEXT,
    }))
    tokenizer = load_tokenizer(folder)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} ids, the model {vocab_size}")
    return tokenizer


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(n: int, vocab_size: int, prompt_len: tuple[int, int], out_len: tuple[int, int],
                  seed: int) -> Workload:
    rng = random.Random(seed * 1000003 + n)
    ids = vocab_size - len(SPECIALS)
    prompts = tuple(tuple(rng.randrange(ids) for _ in range(rng.randint(*prompt_len))) for _ in range(n))
    return Workload(prompts, tuple(rng.randint(*out_len) for _ in range(n)))


def check_detokenizer(tokenizer: Any, vocab_size: int, seed: int, streams: int = 300) -> dict:
    """If Pomona swaps in its own detokenizer, check it gives mlx-lm's text after every token."""
    from engine import text as pomona_text

    fast = getattr(pomona_text, "fast_detokenizer", None)
    mine = fast(tokenizer.detokenizer) if fast else tokenizer.detokenizer
    if fast is None or type(mine) is type(tokenizer.detokenizer):
        return {"detokenizer": type(mine).__name__, "checked": False}
    rng = random.Random(seed)
    mismatches = 0
    for _ in range(streams):
        ref, got = tokenizer.detokenizer, fast(tokenizer.detokenizer)
        for _ in range(rng.randint(1, 64)):
            t = rng.randrange(vocab_size) if rng.random() < 0.7 else rng.randrange(256)
            ref.add_token(t)
            got.add_token(t)
            mismatches += ref.text != got.text
        ref.finalize()
        got.finalize()
        mismatches += ref.text != got.text
    if mismatches:
        raise RuntimeError(f"{type(mine).__name__} differs from mlx-lm's detokenizer ({mismatches} mismatches)")
    return {"detokenizer": type(mine).__name__, "checked": True, "streams": streams, "identical": True}


def engine_detokenizer_class(tokenizer: Any) -> type:
    """The class whose `add_token` Pomona's `TextStream` calls for this tokenizer (public API only)."""
    from engine import text as pomona_text

    fast = getattr(pomona_text, "fast_detokenizer", None)
    return type(fast(tokenizer.detokenizer) if fast else tokenizer.detokenizer)


def environment(params: int, dtype: mx.Dtype) -> dict:
    import mlx_lm

    env = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
           "device": str(mx.default_device()), "params": params, "dtype": str(dtype), "machine": platform.machine(),
           "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        env["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    return env
