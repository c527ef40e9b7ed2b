"""`FlatAttention` (modelio/flat_llama.py): mlx-lm's llama attention for every cache it is given, and the
flat forward's parts each attended as their own forward would."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model

from engine.step.kv_table import Batch, SlotKV, flat_views, layer_shapes
from modelio.flat_llama import FlatAttention, flatten


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path):
    ref, _ = mlx_load_model(tiny_model_dir)
    flat, _ = mlx_load_model(tiny_model_dir)
    assert flatten(flat) == len(flat.model.layers)
    assert all(type(layer.self_attn) is FlatAttention for layer in flat.model.layers)
    assert all(type(layer.mlp) is llama.MLP for layer in flat.model.layers)  # only attention changes
    return ref, flat


def test_every_other_cache_gives_mlx_lms_logits(models) -> None:
    ref, flat = models
    tokens = mx.array([[5, 17, 42, 3, 99, 7, 12, 250, 31, 8]])
    for make in (lambda m: make_prompt_cache(m), lambda m: [RotatingKVCache(max_size=6) for _ in m.layers]):
        a, b = ref(tokens, cache=make(ref)), flat(tokens, cache=make(flat))
        assert mx.array_equal(a, b).item()
    assert mx.array_equal(ref(tokens), flat(tokens)).item()


def test_a_flat_forward_of_two_rows_equals_each_rows_own_forward(models) -> None:
    """Two parts in one flat forward (a 3-token chunk on row 0, a 5-token chunk padded to 8 on row
    1), then a second one continuing both rows at their lengths: each part's last logits are what
    mlx-lm's model gives that prompt alone."""
    ref, flat = models
    kv = SlotKV(layer_shapes(flat), block=8)
    kv.ensure(2, 24)
    prompts = [[5, 17, 42], [9, 8, 7, 6, 250]]
    more = [[33, 2], [61]]
    parts = [Batch(kv, [0], 3, [0], 8), Batch(kv, [0], 8, [1], 8, [5])]
    logits = flat(mx.array(prompts[0] + prompts[1] + [0, 0, 0], dtype=mx.int32)[None], cache=flat_views(parts))
    parts = [Batch(kv, [3], 2, [0], 8), Batch(kv, [5], 1, [1], 8)]
    later = flat(mx.array(more[0] + more[1], dtype=mx.int32)[None], cache=flat_views(parts))
    for prompt, got in ((prompts[0], logits[0, 2]), (prompts[1], logits[0, 3 + 4]),
                        (prompts[0] + more[0], later[0, 1]), (prompts[1] + more[1], later[0, 2])):
        want = ref(mx.array([prompt]), cache=make_prompt_cache(ref))[0, -1]
        assert mx.allclose(got, want, atol=1e-4).item(), prompt


def test_a_quantized_llama_keeps_its_quantized_layers_and_its_logits(tiny_model_dir: Path) -> None:
    """A GPU loads a 4-bit checkpoint as stored: the swap keeps its `QuantizedLinear`s (a module
    rebuilt dense would have no place for their scales)."""
    import mlx.nn as nn

    ref, _ = mlx_load_model(tiny_model_dir)
    nn.quantize(ref, group_size=32, bits=4)
    flat, _ = mlx_load_model(tiny_model_dir)
    nn.quantize(flat, group_size=32, bits=4)
    assert flatten(flat) == len(flat.model.layers)
    attn = flat.model.layers[0].self_attn
    assert type(attn) is FlatAttention and isinstance(attn.q_proj, nn.QuantizedLinear)
    tokens = mx.array([[5, 17, 42, 3, 99, 7, 12, 250, 31, 8]])
    assert mx.array_equal(ref(tokens, cache=make_prompt_cache(ref)), flat(tokens, cache=make_prompt_cache(flat))).item()


def test_other_architectures_are_left_alone() -> None:
    """Both swaps (`flatten` here, the CPU's `accelerate`) change llama blocks only."""
    import mlx.nn as nn

    from modelio.cpu_llama import accelerate

    class NotLlama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(4, 4)]

    assert flatten(NotLlama()) == 0 and accelerate(NotLlama()) == 0
