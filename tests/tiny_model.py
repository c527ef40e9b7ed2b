"""Build a tiny random mlx-lm llama with a locally trained BPE tokenizer (no hub, no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Berlin is the capital of Germany. Madrid is the capital of Spain. "
    "Hello world! How are you today? I am fine, thank you. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026. Unicode: café, naïve, 日本語, emoji 🙂. "
    "def main():\n    print('hello')\n    return 0\n"
) * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 512, extra_special: Sequence[str] = ()) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }))


def build_tiny_model(out: Path, seed: int = 0, layers: int = 2, hidden: int = 64,
                     extra_special: Sequence[str] = ()) -> Path:
    """Write an mlx-lm model directory (config.json, model.safetensors, tokenizer) to `out`.

    `extra_special` adds special tokens (e.g. "<think>", "</think>") after the default three."""
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, extra_special=extra_special)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(vocab),
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": vocab["<|im_end|>"],
        "bos_token_id": vocab["<|im_start|>"],
    }
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Random init gives near-uniform logits and greedy decoding that repeats one token; a wider
    # output head makes it varied and decisive, so near-ties do not make tests flaky.
    weights = dict(tree_flatten(model.parameters()))
    weights["lm_head.weight"] = mx.random.normal(weights["lm_head.weight"].shape) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
