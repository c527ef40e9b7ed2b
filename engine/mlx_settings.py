"""MLX's own process-wide settings that Pomona chooses per backend, applied before the first forward.

MLX reads some of its backend switches from the environment once, at their first use (a C++
static), so they are set before the engine's first forward and never changed afterwards. A value
the user exported already is theirs and is kept.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

import mlx.core as mx

from engine.config import EngineConfig

log = logging.getLogger("pomona.engine")

# MLX's switch for cuDNN's fused attention on its CUDA backend (mlx/backend/cuda/
# scaled_dot_product_attention.cpp, `supports_sdpa_cudnn`); decoding (one query) uses MLX's own
# vector kernel either way.
CUDNN_SDPA_ENV = "MLX_CUDA_USE_CUDNN_SDPA"


def cuda_backend() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


# "auto" `mlx_cache_limit` on the CPU backend. What chose it (2-core box, SmolLM2-135M float32):
# MLX's CPU default of 32 MiB frees every larger buffer to the OS, and a prompt chunk's attention
# scores are larger (256 queries x 9 heads x 4,700 keys: 46 MB a layer), so each layer of each
# chunk page-faulted and zeroed them again. Interleaved in one process: `prefill_attention` for
# that chunk 48 -> 32 ms (768 queries: 160 -> 120 ms); the model's forward of a 256-token chunk
# at 4,608 tokens 1,963 -> 1,606 ms (medians of 8); in the engine, an 800-token follow-up on a
# 4,400-token cached prefix 6.5 -> 5.5 s to its first token (medians of 6, every pair faster).
# 1 GiB holds a step's largest transients several times over (`SCORES_BYTES` bounds a scores
# block to 128 MiB) and is small beside the KV and weights of any model worth serving.
CPU_CACHE_LIMIT = 1 << 30


def cpu_backend() -> bool:
    return mx.default_device() == mx.cpu


def cache_limit(config: EngineConfig, on_cpu: bool) -> int | None:
    """The byte limit `config` gives MLX's buffer cache on this backend (None: MLX's own)."""
    if config.mlx_cache_limit == "auto":
        return CPU_CACHE_LIMIT if on_cpu else None
    return config.mlx_cache_limit  # type: ignore[return-value]


def apply(config: EngineConfig, cuda: bool | None = None,
          environ: MutableMapping[str, str] = os.environ, on_cpu: bool | None = None) -> dict[str, str]:
    """Set what `config` asks of MLX for this backend; returns what it set.

    `cudnn_attention` "auto" is off on CUDA: cuDNN builds a plan per attention shape (query width,
    key length, mask and strides: keyed in MLX's LRU of plans), ~60 ms each on the H200, and an
    agent's growing conversation meets a new shape on ~4 of 9 later turns even with Pomona's
    bucketed prefill shapes (engine TTFT 105-129 ms there against 42-59 ms on turns whose shape was
    seen; benchmarks/agent/agent_breakdown.py, docs/accelerators.md). MLX's attention ops instead run a
    chunk's scores as two matmuls and a softmax: no plan, more memory traffic, which an agent's
    suffix (hundreds of queries) barely notices. Metal and the CPU build no plans: nothing to set.

    `mlx_cache_limit` "auto" raises MLX's buffer cache on the CPU backend only (`CPU_CACHE_LIMIT`);
    GPUs keep MLX's own, which is already their whole memory limit.
    """
    cuda = cuda_backend() if cuda is None else cuda
    on_cpu = cpu_backend() if on_cpu is None else on_cpu
    done: dict[str, str] = {}
    if cuda and config.cudnn_attention is not True and CUDNN_SDPA_ENV not in environ:
        environ[CUDNN_SDPA_ENV] = done[CUDNN_SDPA_ENV] = "0"
    limit = cache_limit(config, on_cpu)
    if limit is not None:
        mx.set_cache_limit(limit)  # process-wide, as the switches above; MLX's public setter
        done["cache_limit"] = str(limit)
    if done:
        log.info("MLX settings for this backend: %s", done)
    return done
