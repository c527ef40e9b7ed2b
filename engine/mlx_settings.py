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


def apply(config: EngineConfig, cuda: bool | None = None,
          environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set what `config` asks of MLX for this backend; returns what it set.

    `cudnn_attention` "auto" is off on CUDA: cuDNN builds a plan per attention shape (query width,
    key length, mask and strides: keyed in MLX's LRU of plans), ~60 ms each on the H200, and an
    agent's growing conversation meets a new shape on ~4 of 9 later turns even with Pomona's
    bucketed prefill shapes (engine TTFT 105-129 ms there against 42-59 ms on turns whose shape was
    seen; benchmarks/agent/agent_breakdown.py, docs/accelerators.md). MLX's attention ops instead run a
    chunk's scores as two matmuls and a softmax: no plan, more memory traffic, which an agent's
    suffix (hundreds of queries) barely notices. Metal and the CPU build no plans: nothing to set.
    """
    cuda = cuda_backend() if cuda is None else cuda
    done: dict[str, str] = {}
    if cuda and config.cudnn_attention is not True and CUDNN_SDPA_ENV not in environ:
        environ[CUDNN_SDPA_ENV] = done[CUDNN_SDPA_ENV] = "0"
    if done:
        log.info("MLX settings for this backend: %s", done)
    return done
