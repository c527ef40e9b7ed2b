"""The CPU fast paths compute what MLX's own functions compute: kernels, attention, whole models."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model

from modelio.cpu_kernels import fast_exp, silu_mul, softmax_parts
from modelio.cpu_llama import CpuAttention, CpuMLP, accelerate, attention
from modelio.models import backend, load_model

DEFAULT_BACKEND = backend()  # before the fixture below pins this module to the CPU


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The fast paths only ever run on the CPU backend: check them there on every machine (a Mac
    has the CPU device too), whatever this machine's default device is."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(previous)


def test_fast_exp_matches_exp_over_float32_range() -> None:
    x = mx.concatenate([mx.linspace(-87.3, 88.0, 100_003), mx.array([0.0, -1e-7, 1e-7, 1.0, -1.0])])
    got, want = np.array(fast_exp(x)), np.array(mx.exp(x))
    assert np.max(np.abs(got - want) / want) < 3e-7
    # Far below the normal range it gives (nearly) 0, as softmax and sigmoid need; never inf or nan.
    tiny = np.array(fast_exp(mx.array([-200.0, -1e30, -float("inf")])))
    assert np.all(tiny < 1e-37) and np.all(tiny >= 0)
    assert np.isfinite(np.array(fast_exp(mx.array([100.0, 1e30])))).all()


def test_silu_mul_and_softmax_match_mlx() -> None:
    mx.random.seed(1)
    gate, up = mx.random.normal((7, 3, 1536)) * 6, mx.random.normal((7, 3, 1536))
    assert mx.allclose(silu_mul(gate, up), swiglu(gate, up), atol=1e-5, rtol=1e-5).item()
    scores = mx.random.normal((4, 3, 5, 37)) * 20
    weights, sums = softmax_parts(scores)
    assert mx.allclose(weights / sums, mx.softmax(scores, axis=-1, precise=True), atol=1e-6).item()


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("L,S", [(1, 1), (1, 19), (5, 5), (4, 23)])
def test_attention_matches_sdpa(heads: int, kv_heads: int, L: int, S: int) -> None:
    mx.random.seed(L * 100 + S)
    B, D = 3, 16
    q, k, v = (mx.random.normal((B, h, n, D)) for h, n in ((heads, L), (kv_heads, S), (kv_heads, S)))
    pad = mx.array([0, 2, S - 1])  # left padding per row, as mlx-lm's batch caches mask it
    keep = (mx.arange(S)[None, None, None, :] >= pad[:, None, None, None]) & \
        (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None])
    masks = [None, keep, mx.where(keep, 0.0, -1e9).astype(mx.float32), "causal"]  # one query: causal is every key
    for mask in masks:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = attention(q, k, v, 0.25, mask)
        assert mx.allclose(got, want, atol=2e-5).item(), f"mask {type(mask)} L={L} S={S}"


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path):
    ref, _ = mlx_load_model(tiny_model_dir)
    fast, _ = mlx_load_model(tiny_model_dir)
    assert accelerate(fast) == len(fast.model.layers)
    assert all(type(layer.self_attn) is CpuAttention and type(layer.mlp) is CpuMLP for layer in fast.model.layers)
    return ref, fast


def test_accelerated_model_keeps_parameters_and_logits(models) -> None:
    ref, fast = models
    assert sorted(k for k, _ in _flat(ref)) == sorted(k for k, _ in _flat(fast))
    tokens = mx.array([[5, 17, 42, 3, 99, 7, 12, 250, 31, 8]])
    for make in (lambda m: make_prompt_cache(m), lambda m: [RotatingKVCache(max_size=6) for _ in m.layers]):
        _same_logits(ref, fast, tokens, make)


def test_quantized_kv_cache_takes_mlx_lms_path() -> None:
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300)
    ref = llama.Model(args)
    fast = llama.Model(args)
    fast.update(ref.parameters())
    assert accelerate(fast) == 2
    tokens = mx.array([[5, 17, 42, 3, 99, 7, 12, 250, 31, 8]])
    _same_logits(ref, fast, tokens, lambda m: [QuantizedKVCache(group_size=32, bits=8) for _ in m.layers])


def _same_logits(ref, fast, tokens, make_cache) -> None:
    c_ref, c_fast = make_cache(ref), make_cache(fast)
    a, b = ref(tokens, cache=c_ref), fast(tokens, cache=c_fast)
    assert mx.allclose(a, b, atol=1e-4).item()
    for step in range(4):  # decode on top of the prefilled cache
        nxt = a[:, -1:].argmax(-1)
        a, b = ref(nxt, cache=c_ref), fast(nxt, cache=c_fast)
        assert mx.allclose(a, b, atol=1e-4).item(), f"decode step {step}"


def test_batch_generator_greedy_tokens_unchanged(models) -> None:
    ref, fast = models
    prompts = [[5, 17, 42], [3, 99, 7, 12, 250, 31, 8, 60, 61], [9] * 20, [100, 200]]  # left padding differs

    def run(model) -> dict[int, list[int]]:
        gen = BatchGenerator(model, max_tokens=12, stop_tokens=None, completion_batch_size=4, prefill_batch_size=4)
        uids = gen.insert(prompts)
        out: dict[int, list[int]] = {u: [] for u in uids}
        while True:
            _, responses = gen.next()
            if not responses and all(len(v) == 12 for v in out.values()):
                break
            for r in responses:
                out[r.uid].append(r.token)
        gen.close()
        return {i: out[u] for i, u in enumerate(uids)}

    assert run(fast) == run(ref)


@pytest.mark.skipif(DEFAULT_BACKEND != "cpu", reason=f"load_model applies the CPU fast paths only where the default "
                    f"backend is the CPU; here it is {DEFAULT_BACKEND}")
def test_load_model_applies_fast_paths_only_to_float32_on_cpu(tiny_model_dir: Path) -> None:
    on = load_model(tiny_model_dir)
    assert "CPU fast paths" in on.weights_dtype
    assert all(type(layer.self_attn) is CpuAttention for layer in on.model.model.layers)
    off = load_model(tiny_model_dir, cpu_fast_paths=False)
    half = load_model(tiny_model_dir, dtype="float16")
    for loaded in (off, half):
        assert "CPU fast paths" not in loaded.weights_dtype
        assert all(type(layer.self_attn) is llama.Attention for layer in loaded.model.model.layers)


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_prefill_chunks_use_numpy_attention_and_decode_the_fast_softmax_on_long_contexts(models, monkeypatch) -> None:
    """Prefill chunks (more than FEW_QUERIES queries) go to `prefill_attention`;
    decode-sized calls to the materialised fast softmax once the context has FAST_SOFTMAX_MIN_KEYS
    keys, to MLX's SDPA before (where it is faster). Same logits as mlx-lm's model every way."""
    import modelio.cpu_llama as cpu_llama

    ref, fast = models
    n = cpu_llama.FEW_QUERIES + 8  # a few queries on a short context (a verification) take MLX's SDPA
    monkeypatch.setattr(cpu_llama, "FAST_SOFTMAX_MIN_KEYS", n + 2)  # the second decode step reaches it
    calls: list[tuple[str, int]] = []
    for name in ("attention", "prefill_attention"):
        real = getattr(cpu_llama, name)
        monkeypatch.setattr(cpu_llama, name,
                            lambda q, *a, _n=name, _f=real: calls.append((_n, q.shape[2])) or _f(q, *a))
    prompt = mx.array([[i % 200 + 3 for i in range(n)]])
    caches = make_prompt_cache(fast), make_prompt_cache(ref)
    got, want = fast(prompt, cache=caches[0]), ref(prompt, cache=caches[1])
    layers = len(fast.model.layers)
    assert calls == [("prefill_attention", n)] * layers and mx.allclose(got, want, atol=1e-4).item()
    for expected in ([], [("attention", 1)] * layers):  # n + 1 keys: SDPA; n + 2: the fast softmax
        calls.clear()
        step = mx.array([[7]])
        got, want = fast(step, cache=caches[0]), ref(step, cache=caches[1])
        assert calls == expected and mx.allclose(got, want, atol=1e-4).item()


def test_mlp_takes_silu_mul_from_two_rows(models, monkeypatch) -> None:
    """One decoding sequence (one row) takes mlx-lm's compiled swiglu, two rows and more `silu_mul`;
    the same output either way."""
    import modelio.cpu_llama as cpu_llama

    ref, fast = models
    rows: list[int] = []
    real = cpu_llama.silu_mul
    monkeypatch.setattr(cpu_llama, "silu_mul", lambda g, u: rows.append(g.shape[0] * g.shape[1]) or real(g, u))
    mlp, ref_mlp = fast.model.layers[0].mlp, ref.model.layers[0].mlp
    for shape in ((1, 1), (2, 1), (1, 3)):
        x = mx.random.normal((*shape, fast.args.hidden_size))
        assert mx.allclose(mlp(x), ref_mlp(x), atol=1e-4).item()
    assert rows == [2, 3]


def _padding_mask(B: int, L: int, S: int, pads: list[int]) -> mx.array:
    """(B, 1, L, S) causal mask with each row's first `pads[b]` keys masked (left padding)."""
    q_pos = mx.arange(S - L, S)[:, None]
    k_pos = mx.arange(S)[None]
    causal = q_pos >= k_pos
    return mx.stack([causal & (k_pos >= p) for p in pads])[:, None]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "row-blocks"])
@pytest.mark.parametrize("kind", ["causal", "bool-padding", "additive", "none"])
def test_prefill_attention_equals_mlx_sdpa(kind, split, monkeypatch) -> None:
    """Against MLX's own SDPA on the CPU: grouped KV heads, a batch of two, strided cache views, and
    masks as mlx-lm builds them (a fully masked padding row stays finite, as MLX's is); also with
    the scores bound so small that the queries go in blocks of a few rows."""
    import modelio.cpu_llama as cpu_llama
    from modelio.cpu_llama import prefill_attention

    if split:
        monkeypatch.setattr(cpu_llama, "SCORES_BYTES", 4 * 2 * 6 * 104 * 7)  # 7 query rows a block
    with mx.stream(mx.cpu):
        mx.random.seed(5)
        B, H, Hk, L, S, D = 2, 6, 2, 40, 104, 16
        q = mx.random.normal((B, H, L, D))
        buffer = mx.random.normal((2, B, Hk, 256, D))  # a cache buffer larger than what is used
        k, v = buffer[0][..., :S, :], buffer[1][..., :S, :]
        if kind == "causal":
            mask = "causal"
        elif kind == "bool-padding":
            mask = _padding_mask(B, L, S, [0, 70])  # row 2's first queries see only padding
        elif kind == "additive":
            mask = mx.random.normal((B, 1, L, S))
        else:
            mask = None
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = prefill_attention(q, k, v, 0.25, mask)
        assert got.shape == want.shape and got.dtype == mx.float32
        assert not mx.any(mx.isnan(got)).item()
        if kind == "bool-padding":  # rows with every key masked: any finite value will do
            seen = mx.any(_padding_mask(B, L, S, [0, 70]), axis=-1, keepdims=True)
            got, want = mx.where(seen, got, 0), mx.where(seen, want, 0)
        assert mx.allclose(got, want, atol=1e-5).item()


def test_scores_block_stays_in_mlx_buffer_cache() -> None:
    """A scores block of SCORES_BYTES, once freed, is kept by MLX's allocator for the next layer's
    block (larger buffers go back to the system and are faulted in again every layer)."""
    from modelio.cpu_llama import SCORES_BYTES

    with mx.stream(mx.cpu):
        mx.clear_cache()
        block = mx.zeros((SCORES_BYTES // 4,), dtype=mx.float32)
        mx.eval(block)
        del block
        assert mx.get_cache_memory() >= SCORES_BYTES
        mx.clear_cache()
