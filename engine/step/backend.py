"""How the own step differs between a CPU and a GPU: one record, chosen once per runner.

Why two: a CPU pays real compute for every padded position, idle row and padded key, but compiles
nothing; a GPU computes padding almost for free but compiles a kernel for every new shape, and its
step is bound by the host building it. So the CPU step is exact (rows, keys, one forward per prompt
chunk) and fuses what it can into one flat forward, while the GPU step pads to a few bucketed
shapes and overlaps building a step with the previous one running. The step
(engine/step/step_runner.py) reads these fields; it has no device checks of its own, so a test can
run the GPU's step on a CPU (`StepRunner(..., on_cpu=False)`).

Imports no MLX, so the choice is tested with no model at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.step.plan import round_up

POSITION_BLOCK_GPU = 256  # key-length bucket and growth step on a GPU
POSITION_BLOCK_CPU = 64  # on a CPU attention over padded keys costs real compute: finer buckets

# What a step costs apart from its positions, in positions (the acceptance floor of a proposal,
# `StepRunner._proposals`). The 2-core box, SmolLM2-135M float32: a decode step of one row ~60 ms,
# each further position (a decoding row or a verified proposal) ~5-6 ms (8 rows ~118 ms, 8 rows
# plus 8 proposals ~153-200 ms): about 8-10 positions' worth. A GPU step is bound by the host
# building it (H200, 1B: 4.3 ms for 1 row, 7.6 ms for 32): positions are nearly free until hundreds.
SPEC_FIXED_POSITIONS_CPU = 8
SPEC_FIXED_POSITIONS_GPU = 256
# Most decoding rows with which a CPU step still verifies proposals. On the 2-core box (SmolLM2-135M,
# CPU seconds per token, closed loop of 16 requests at 8 concurrent) proposals at 8 rows gained 15%
# on the code-edit workload and lost 12% on random text though 84% of them were accepted: a
# verifying step's forward costs ~28 ms more than a plain one there (its extra parts) on top of
# ~7 ms a position; at 1 row they gained 1.3-2.3x.
SPEC_MAX_ROWS_CPU = 4  # a verifying step does not overlap the previous one: some floor on any backend


@dataclass(frozen=True)
class StepBackend:
    # Which device's defaults the step takes (`EngineConfig.for_backend`, speculation's "auto").
    on_cpu: bool
    # Key-length bucket and growth step of the KV table (`SlotKV`).
    position_block: int
    # Decode rows and prompt chunks in one flat forward (the CPU fast-path llama's `flat_attention`):
    # a CPU forward costs about one pass over the weights whatever its rows. Only where the model's
    # attention takes the flat view (`supports_flat`).
    flat: bool
    # A step computes exactly the rows in use (an idle row costs a CPU a whole row's compute), or a
    # power of two of them (an idle row costs a GPU almost nothing, a new shape a compile): `row_bucket`.
    exact_rows: bool
    # A forward's key length exact (no padded key costs compute, and a one-row chunk's mask is plain
    # causal: `RowsView.make_mask`), or rounded up to `position_block` (each new shape is a compile).
    exact_keys: bool
    # A step's prompt chunks in one forward padded to the longest (GPU), or one forward each
    # (padding would cost a CPU real compute).
    prefill_together: bool
    # A prefill forward's width and key length from a few buckets (`prefill_shape`), on an
    # unbounded table; else its exact width.
    bucketed_prefill: bool
    # Verifying rows padded to the most proposals a row may make (one shape whatever the
    # proposals), or only to the step's longest.
    fixed_verify_width: bool
    # A step's cost apart from its positions, in positions (`SPEC_FIXED_POSITIONS_*`).
    spec_fixed_positions: int
    # Most decoding rows with which a step still verifies proposals (None: no limit).
    spec_max_rows: int | None
    # Whether a step verifies only where its timed cost was measured to pay (`SpecGate`): a GPU's
    # verifying step gives up overlapping the next step's building with the device's work, which
    # can cost as much as the step; a CPU's step never overlapped much (its row limit instead).
    spec_gate: bool
    # Where a step's time (for the stall budget) is measured: a CPU step's forward mostly runs while
    # it is built (the fast paths evaluate as they go), so a call's time is the step it built; a GPU
    # step runs between two read-backs, so that time is the step read.
    runs_while_built: bool
    # Whether a verifying step may be built before the step in flight is read back, on the guess
    # that the rows it verified accept all their proposals (`StepRunner._chains`): a GPU step's
    # building overlaps the device's work only so; a CPU step mostly runs while it is built.
    chain_verify: bool


CPU = StepBackend(on_cpu=True, position_block=POSITION_BLOCK_CPU, flat=True, exact_rows=True, exact_keys=True,
                  prefill_together=False, bucketed_prefill=False, fixed_verify_width=False,
                  spec_fixed_positions=SPEC_FIXED_POSITIONS_CPU, spec_max_rows=SPEC_MAX_ROWS_CPU,
                  spec_gate=False, runs_while_built=True,
                  chain_verify=False)
GPU = StepBackend(on_cpu=False, position_block=POSITION_BLOCK_GPU, flat=False, exact_rows=False, exact_keys=False,
                  prefill_together=True, bucketed_prefill=True, fixed_verify_width=True,
                  spec_fixed_positions=SPEC_FIXED_POSITIONS_GPU, spec_max_rows=None, spec_gate=True,
                  runs_while_built=False, chain_verify=True)


def step_backend(on_cpu: bool, flat_supported: bool) -> StepBackend:
    """The record for a device; a CPU's step takes the flat forward only where the model supports it."""
    return replace(CPU, flat=flat_supported) if on_cpu else GPU


def prefill_shape(tokens: int, start: int, block: int) -> tuple[int, int]:
    """A GPU prefill forward's (query width, key length) for `tokens` new tokens after `start`,
    from a few buckets: the width a multiple of `block`, the key length a multiple of an eighth of
    its next power of two (at least `block`). Why: on MLX's CUDA backend the first forward of a
    shape cost an agent's turn ~90 ms more than the same shape again (H200, smollm2 shape, 15-20k
    tokens: engine TTFT 143-201 ms the first time, 54-85 ms under another cache salt;
    benchmarks/agent/agent_breakdown.py), and every turn of a growing conversation has a shape of its
    own. Padding is masked (queries past a row's tokens are never read, keys past its length never
    attended) and costs a GPU little: at most an eighth more keys and a block more queries.
    Measured (H200 agent session, benchmarks/results/device-s16/): these buckets, later turns
    84-204 ms over HTTP (median 0.59x mlx_lm.server); widths in powers of two instead, 92-254 ms
    (0.82x): wider chunks cost more than the shapes they spared. A session still meets a new
    (width, key length) pair on about 4 of 9 later turns (engine TTFT 105-129 ms there against
    42-59 ms on the others): a first-use cost of MLX's CUDA backend."""
    width = round_up(max(1, tokens), block)
    end = start + width
    step = max(block, (1 << max(end - 1, 1).bit_length()) // 8)
    return width, round_up(end, step)
