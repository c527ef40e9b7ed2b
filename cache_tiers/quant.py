"""Optional quantized storage: blocks of long offers kept as 4- or 8-bit KV (config `quantize_bits`).

Why: KV state is large (46 KB per token for SmolLM2-135M in float32), and at 8 bits with group
size 64 it takes about a quarter of that, so the same RAM and SSD budgets hold about 4x the
prefixes. The cost is a small, bounded change in the attention inputs, so it is off by default
and applied only to the new blocks of offers of at least `min_tokens` tokens (short ones save
little). Each block is quantized along its head dim with `mx.quantize` (blocks.cut_blocks) and
dequantized when a restore assembles it, so the engine still receives plain `KVCache` objects;
a model whose head dim the group size does not divide is stored as it is. A hybrid model's exact
(state-space) layers are never quantized: small, and carrying every token's influence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantPolicy:
    bits: int
    group_size: int = 64
    min_tokens: int = 256
