"""Model directories for benchmarks: the default model, and a float32 copy that every server loads.

On the Linux CPU backend quantized and bf16 matmuls are many times slower than float32 with
OpenBLAS, and the peers (mlx_lm.server, vllm-mlx) load a directory as it is, so all servers are
given the same float32 directory: the comparison is then about serving, not about weight formats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")


def default_model_dir() -> Path:
    """The default model's mlx-lm directory, converted by modelio.models on first use."""
    from modelio.models import resolve_model

    return Path(resolve_model("default"))


def float32_copy(src: str | Path, dst: str | Path | None = None, force: bool = False) -> Path:
    """Write (once) a float32, unquantized copy of the mlx-lm directory `src`; returns its path.

    Default destination: `<src>-float32` next to the source. Tokenizer and chat-template files
    are copied unchanged; `quantization` entries are dropped from config.json."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model, load_model, save_model

    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(src.name + "-float32")
    marker = dst / ".pomona-float32"
    if marker.exists() and not force:
        return dst
    model, config = load_model(src, lazy=False)
    model = dequantize_model(model)
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    skip = {"config.json", "model.safetensors.index.json"}
    for f in src.iterdir():
        # pomona_* files are modelio.models' build records of the source dir, not of this copy.
        if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and f.name not in skip \
                and not f.name.startswith("pomona_"):
            shutil.copy2(f, dst / f.name)
    raw = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        raw.pop(key, None)
    raw["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    marker.write_text(str(src.resolve()))
    return dst


def benchmark_model_dir(model: str | None = None) -> Path:
    """`model` if given (a directory), else the default model's float32 copy."""
    if model and model != "default":
        return Path(model)
    return float32_copy(default_model_dir())
