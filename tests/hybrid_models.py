"""Tiny random hybrid (state-space + attention) mlx-lm models, written like tiny_model.py's llama.

Each is a real mlx-lm architecture with random weights and the locally trained tokenizer, so the
engine loads it with `mlx_lm.load` as it would a hub model. Their caches mix mlx-lm's
`ArraysCache` (state-space layers: not trimmable) with `KVCache`, or nest both in a `CacheList`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tiny_model import build_tokenizer

HIDDEN = 64


def _configs(vocab: int) -> dict[str, dict[str, Any]]:
    common = {"vocab_size": vocab, "hidden_size": HIDDEN, "tie_word_embeddings": False}
    return {
        # three gated-delta (linear attention) layers, then one full-attention layer
        "qwen3_next": dict(common, model_type="qwen3_next", num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                           num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=0,
                           mlp_only_layers=[], moe_intermediate_size=0, rms_norm_eps=1e-6, rope_theta=10000.0,
                           partial_rotary_factor=0.25, max_position_embeddings=4096, full_attention_interval=4),
        # mamba2 layers only: every layer's state is an ArraysCache
        "mamba2": dict(common, model_type="mamba2", num_heads=8, head_dim=16, expand=2, intermediate_size=128,
                       state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                       use_bias=False, use_conv_bias=True, time_step_limit=[0.0, 1e9], time_step_rank="auto"),
        # mamba, attention, mamba, MLP
        "nemotron_h": dict(common, model_type="nemotron_h", intermediate_size=128, max_position_embeddings=4096,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
                           mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                           conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                           use_conv_bias=True, hybrid_override_pattern=["M", "*", "M", "-"]),
        # every layer a CacheList(ArraysCache, KVCache): mamba and attention side by side
        "falcon_h1": dict(common, model_type="falcon_h1", num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
                          mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                          rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096),
    }


ARCHITECTURES = tuple(_configs(0))


def build_hybrid_model(out: Path, model_type: str, seed: int = 0) -> Path:
    """Write a tiny random `model_type` model directory (config.json, weights, tokenizer) to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = dict(_configs(len(vocab))[model_type], eos_token_id=vocab["<|im_end|>"],
                  bos_token_id=vocab["<|im_start|>"])
    (out / "config.json").write_text(json.dumps(config))
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # As in tiny_model.py: a wider output head makes greedy decoding varied and decisive.
    head = "lm_head.weight"
    weights[head] = mx.random.normal(weights[head].shape) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """`hybrid_model_dir(model_type)`: that tiny model's directory, built once per test session."""
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_hybrid_model(tmp_path_factory.mktemp(model_type), model_type)
        return built[model_type]

    return get
