"""Optional quantized storage: long entries kept as 4- or 8-bit KV (config `quantize_bits`).

Why: KV state is large (46 KB per token for SmolLM2-135M in float32), and at 8 bits with group
size 64 it takes about a quarter of that, so the same RAM and SSD budgets hold about 4x the
prefixes. The cost is a small, bounded change in the attention inputs, so it is off by default
and applied only to entries of at least `quantize_min_tokens` (short ones save little). The
engine still receives plain `KVCache` objects: `snapshot.restore` dequantizes (mlx-lm's
BatchGenerator merges plain caches, not `QuantizedKVCache`s). In a hybrid model only the KVCache
layers are quantized.

A stored-quantized layer keeps class name "KVCache" with the slot layout of mlx-lm's
`QuantizedKVCache.state`: ((wq, scales, biases), (wq, scales, biases), offset, group_size, bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .snapshot import LayerSnapshot, Snapshot, leaves


@dataclass(frozen=True)
class QuantPolicy:
    bits: int
    group_size: int = 64
    min_tokens: int = 256

    def applies(self, snap: Snapshot) -> bool:
        """Long enough, with at least one plain KVCache layer and every such layer's head dims a
        multiple of the group size. Other layers (a hybrid model's state-space layers: small, and
        carrying every token's influence) are stored as they are."""
        if snap.num_tokens < self.min_tokens:
            return False
        kv = [layer for layer in snap.layers if _plain_kv(layer)]
        return bool(kv) and all(layer.slots[0].shape[-1] % self.group_size == 0
                                and layer.slots[1].shape[-1] % self.group_size == 0 for layer in kv)


def _plain_kv(layer: LayerSnapshot) -> bool:
    return layer.cls == "KVCache" and isinstance(layer.slots[0], mx.array)


def quantize(snap: Snapshot, policy: QuantPolicy) -> Snapshot:
    """`snap` with every KVCache layer's keys and values quantized, or `snap` itself if the policy
    does not apply."""
    if not policy.applies(snap):
        return snap
    layers = []
    for layer in snap.layers:
        if not _plain_kv(layer):
            layers.append(layer)
            continue
        k, v, n = layer.slots
        qk, qv = (tuple(mx.quantize(x, group_size=policy.group_size, bits=policy.bits)) for x in (k, v))
        layers.append(LayerSnapshot("KVCache", (qk, qv, n, policy.group_size, policy.bits)))
    arrays = [a for layer in layers for a in leaves(layer.slots)]
    mx.eval(*arrays)
    nbytes = sum(a.nbytes for a in arrays) + snap.tokens.nbytes
    return Snapshot(snap.tokens, tuple(layers), nbytes, snap.trimmable)
