"""Convert a llama-architecture GGUF file (as `mx.load` reads it) into an mlx-lm model directory.

The output is an ordinary mlx-lm directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so `mlx_lm.load`, `python -m mlx_lm server` and vllm-mlx can all open it.
Quantized GGUF blocks (Q4_0/Q4_1/Q8_0) come out of `mx.load` as MLX affine triples
(weight/scales/biases, group size 32) and are stored as they are: no re-quantization, no loss.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

# ggml quantizes in blocks of 32 values along a row (QK4_0 = QK4_1 = QK8_0 = 32).
GGML_GROUP_SIZE = 32
TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens such as <|im_end|>

# GGUF tensor base names -> mlx-lm llama module paths. `{n}` is the block index.
_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)$")


@dataclass(frozen=True)
class LlamaHParams:
    """The `llama.*` hyper-parameters of a GGUF file, named as in an HF/mlx-lm config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool


def _scalar(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _f32(value: float) -> float:
    # GGUF stores float32; print it at float32 precision so 1e-5 stays 1e-5, not 9.9999997e-06.
    return float(str(np.float32(value)))


def read_hparams(meta: Mapping[str, Any], tensors: Mapping[str, mx.array]) -> LlamaHParams:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, this one is {arch!r}")
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    return LlamaHParams(
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        head_dim=int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=_f32(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_scalar(meta, "llama.context_length")),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        # llama.cpp omits output.weight when the head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
    )


def _mlx_name(gguf_name: str) -> str:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales'."""
    base, _, leaf = gguf_name.rpartition(".")
    match = _BLOCK_RE.match(base)
    if match:
        key, n = f"blk.{{n}}.{match.group(2)}", match.group(1)
    else:
        key, n = base, ""
    if key not in _TENSOR_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_TENSOR_NAMES[key].format(n=n)}.{leaf}"


def unpermute_rows(rows: mx.array, n_head: int) -> mx.array:
    """Invert llama.cpp's `permute` of attn_q / attn_k rows.

    convert_hf_to_gguf.py does `w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)` so
    each head's two rotary halves become interleaved pairs (llama.cpp's rotary layout). The
    inverse reads the rows as (n_head, d/2, 2) and swaps back. Only output rows move, and ggml
    quantizes each row on its own, so packed weight, scales and biases can all be permuted alike.
    """
    d = rows.shape[0]
    rest = rows.shape[1:]
    return rows.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(d, *rest)


def convert_tensors(tensors: Mapping[str, mx.array], hp: LlamaHParams) -> dict[str, mx.array]:
    """Rename to mlx-lm names and undo the q/k permutation; values are stored as read.

    Norm vectors stay float32 as in the file. That makes activations float32 under the quantized
    weights, which the CPU backend needs: its quantized matmul ran 40-50x slower with float16
    activations (80 ms vs 1.8 ms for a 1536x576 4-bit layer), so a float16 directory crawled under
    `mlx_lm server` or vllm-mlx here. On Metal it costs float32 activations and KV cache.
    """
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        if ".attn_q." in name:
            value = unpermute_rows(value, hp.num_attention_heads)
        elif ".attn_k." in name:
            value = unpermute_rows(value, hp.num_key_value_heads)
        out[_mlx_name(name)] = value
    return out


def quantization_config(weights: Mapping[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm "quantization" entry: the most common bit width, plus per-module overrides.

    mlx-lm's `load_model` passes a per-module dict (keyed by module path) straight to
    `to_quantized`, so mixed files such as SmolLM2's (8-bit embedding, 4-bit elsewhere) load.
    """
    bits: dict[str, int] = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            # A packed uint32 row holds in_dims * bits / 32 words; scales hold in_dims / group_size.
            packed = weights[f"{module}.weight"].shape[-1]
            bits[module] = packed * 32 // (scales.shape[-1] * GGML_GROUP_SIZE)
    if not bits:
        return None
    default_bits = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGML_GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != default_bits:
            config[module] = {"group_size": GGML_GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def model_config(hp: LlamaHParams, meta: Mapping[str, Any], quant: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{k: getattr(hp, k) for k in LlamaHParams.__dataclass_fields__},
        "rope_traditional": False,  # rows were un-permuted back to the HF (half-split) layout
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",  # the dense tensors (norms); see convert_tensors
    }
    if quant is not None:
        # mlx-lm writes both keys; some readers (vllm-mlx, older mlx-lm) look at only one.
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # SmolLM2's HF tokenizer splits every digit on its own before the GPT-2 regex runs.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "default"):
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt-2)")


def write_tokenizer(meta: Mapping[str, Any], out: Path) -> None:
    """Build tokenizer.json + tokenizer_config.json from the GGUF's `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _scalar(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only GPT-2 style byte-level BPE GGUF tokenizers are supported, not {kind!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"])
    # Byte-level BPE spells a space as 'Ġ', so a literal space only separates the merge pair.
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(_scalar(meta, "tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [tokens[i] for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta, key))] if key in meta else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        "additional_special_tokens": special,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write an mlx-lm model directory for the llama GGUF file `gguf` into the existing dir `out`."""
    tensors, meta = mx.load(str(gguf), return_metadata=True)
    hp = read_hparams(meta, tensors)
    weights = convert_tensors(tensors, hp)
    quant = quantization_config(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model_config(hp, meta, quant), indent=2))
    write_tokenizer(meta, out)
