"""Engine settings: one frozen dataclass, validated once, built from serve_config.yaml values."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from cache_tiers.config import CacheConfig
from engine.step.speculative import SpecConfig, parse_speculative


CPU_PREFILL_CHUNK = 256
GPU_PREFILL_CHUNK = 2048
FIRST_TOKEN_READS = ("auto", "now", "hits", "next_step")  # EngineConfig.first_token_read


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    max_running: int = 32  # sequences decoding together
    # "pomona": the engine's own batched step (engine/step/step_runner.py): prompts fed in chunks inside
    # decode steps, a KV table of reusable rows; models it cannot run fall back to "mlx_lm"
    # (mlx-lm's BatchGenerator, the reference), logged once.
    engine_step: str = "pomona"
    # The own step keeps a step that also feeds prompt chunks within this many times a plain decode
    # step, pricing prompt tokens from the step times measured so far; null (the default): only
    # max_batch_tokens and prefill_chunk bound the chunks. Off by default because a step's cost is
    # mostly per forward, not per token, on both backends here: on a CPU a chunk's forward alone costs
    # about a decode step (one more pass over the weights), and on MLX's CUDA backend a step is bound
    # by the host building it, so the per-token price came out high, the chunks were cut to 16
    # tokens and the batch never filled (1B, 128 concurrent: 442 tok/s against BatchGenerator's
    # 3,608; benchmarks/results/accelerators-engine-runs.md, session 14).
    max_decode_stall: float | None = None
    max_waiting: int = 256  # bounded waiting queue; past it requests are refused as overloaded
    # Token budget: of prompts admitted into prefill at once, and (own step) of one step's tokens,
    # one per decoding sequence plus the prompt chunks fed beside them.
    max_batch_tokens: int = 8192
    # Prompt tokens per prefill step; bounds the stall of running decodes. "auto": 256 on the CPU
    # backend (a prompt token there costs about a decoding row, so smaller chunks keep decodes
    # flowing: session 15's decode-stall runs), 2048 on GPUs, mlx-lm's own prefill step: on the
    # H200 (smollm2 shape, 32k context, agent session, 3d6fa17) a 15-20k-token cold turn took
    # 1.06 s with 2048 against 3.84-6.24 s with 256 (58 steps, each a whole batch step), and 1B
    # random prompts over HTTP gained at 32/128 concurrent (2,110/3,743 against 1,886/3,502 tok/s).
    prefill_chunk: int | str = "auto"
    prefill_batch: int = 8  # prompts prefilled together (grouped by length)
    # A short prompt joins a running prefill only within this length ratio (padding costs compute
    # on a CPU); "auto" groups on the CPU backend and not on GPUs, where padding is nearly free but
    # an extra prefill step costs a whole decode step. null: never group.
    prefill_group_ratio: float | str | None = "auto"
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # Admit nobody while an admitted prompt awaits its first token (mlx-lm returns it two steps
    # after the prompt is fed, and a newcomer's prefill would run inside both): lower TTFT.
    # "auto": on the CPU backend only; on a GPU the extra steps it causes cost 9-12% throughput at
    # 128 concurrent (benchmarks/results/accelerators-engine-runs.md, run F) while a step there is a few milliseconds.
    first_token_first: bool | str = "auto"
    # On a prefix-cache hit, prefill the uncached rest of the prompt (up to this many tokens) outside
    # the batch and sample the first token at once: mlx-lm returns a new prompt's first token only
    # after three batch steps, each carrying the running batch's decode. "auto": up to prefill_chunk
    # tokens on the CPU backend, off on GPUs (there batched prefill is cheaper and a step is short).
    # Only hits whose cached prefix is at least as long as the rest take it (see Engine._admit).
    direct_first_token: int | str | None = "auto"
    # When a step samples a prompt's first token, whether that step is read back at once (the
    # token leaves in the same engine step) or while the next step runs, as every step is: the
    # next step's building then no longer overlaps this step's device work, once. "now": every
    # prompt's; "hits": a prefix hit's (cached prefix at least as long as the rest it fed: an
    # agent's or a chat's next turn); "next_step": none. "auto": "now" on the CPU backend, whose
    # steps with prompt chunks are evaluated as they are built (nothing overlaps to lose; the
    # first token came one whole step later, ~80-110 ms at an agent's context there);
    # "hits" on GPUs: measured on an H100 (session 26, benchmarks/results/device-s26/run2-*: the
    # reuse part beside `pomona`'s then "next_step"), a prefix hit's TTFT p50 162 -> 105 ms and a
    # multi-turn's 169 -> 127 ms; in process, the prefix part's 90 -> 83 ms. A cold prompt's first
    # token is mostly prefill there, so overlapping the next step's building is kept for it.
    first_token_read: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_kv_size: int | None = None  # rotating KV cache bound per request (tokens)
    request_timeout_s: float | None = 600.0
    dtype: str | None = None  # None: float32 on CPU, keep checkpoint dtype/quantization on GPU
    # CPU backend, float32 llama models: SiLU and softmax from multiply-adds (modelio.cpu_kernels),
    # since MLX's CPU exp is scalar; within 3e-7 of exp, greedy outputs unchanged. No effect on GPUs.
    cpu_fast_paths: bool = True
    warmup_prompts: tuple[str, ...] = ()
    # Offer the partial prompt cache every N prefilled tokens (a long prefill leaves a resumable
    # trail). "auto" (engine/checkpoints.py): 1024 on the CPU backend and for hybrid models (their
    # state serves only block boundaries); off on GPUs for plain-attention models, where a prefill
    # is fast and each checkpoint copies the row so far (H200, 3d6fa17: the agent session's cold
    # turn 1.06 s without checkpoints and 2048-token chunks).
    checkpoint_every: int | str | None = "auto"
    memory_budget_bytes: int | None = None  # one account for running KV + the RAM cache tier
    cache: CacheConfig = CacheConfig()
    # Speculative decoding in the own step (engine/step/speculative.py): "off", "auto" or a mapping
    # (method: prompt_lookup | draft, max_tokens: proposals a row verifies per step, ngram_max,
    # ngram_min, draft_model: a same-tokenizer model's path for method draft).
    # "auto": prompt lookup where it was measured to pay (the CPU while at most 4 rows decode,
    # docs/measurements.md) and on GPUs until measured there. Not on ring tables (max_kv_size) nor
    # on mlx-lm's BatchGenerator.
    speculative: str | SpecConfig = "auto"
    # MLX's CUDA backend runs a prompt chunk's attention through cuDNN, which builds a plan for every
    # new (query, key, mask) shape and stride: ~60 ms each on the H200, and a growing conversation
    # meets a new shape on about half its turns. false: MLX's own attention ops instead (no plan,
    # the scores materialised); "auto": false on CUDA (engine/mlx_settings.py says what chose it).
    # No effect on Metal or the CPU, where MLX builds no per-shape plans.
    cudnn_attention: bool | str = "auto"
    # Own step: a step's decode rows and prompt chunks as one forward (each projection and MLP run
    # once over all their tokens, attention per part: modelio/flat_llama.py) rather than two (the
    # decode rows', then the chunks'), for llama models. "auto": on, on every backend, as measured on
    # each: on the CPU a chunk in a forward of its own nearly doubled a decoding step
    # (docs/measurements.md, session 15); on the H100 (session 28, `device_http.sh prefixpart`, the
    # engine in process) the batch of a prefix hit's admitting step ran in 25.9 ms against 33.0 (p50), its TTFT
    # p50 / mean 58.4 / 63.5 ms against 62.6 / 94.6, and the device host built such a step 10 %
    # faster at 1 / 8 / 32 rows (benchmarks/engine/step_build.py). false: two forwards.
    flat_step: bool | str = "auto"
    # The engine process's interpreter switch interval (`sys.setswitchinterval`), in ms: how long
    # its event loop (requests in, each step's events out) may wait for the interpreter while the
    # MLX thread builds a step in Python. null: Python's 5 ms. Applied where the engine runs in a
    # process of its own (deployments/engine_worker.py), never in a replica shared with Serve.
    switch_interval_ms: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk != "auto" and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ValueError(f'engine.prefill_chunk must be an integer >= 1 or "auto", got {self.prefill_chunk!r}')
        for name in ("max_running", "max_waiting", "max_batch_tokens", "prefill_batch",
                     "max_tokens_limit", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.engine_step not in ("pomona", "mlx_lm"):
            raise ValueError('engine.engine_step must be "pomona" or "mlx_lm"')
        if self.max_decode_stall is not None and (
                not isinstance(self.max_decode_stall, (int, float)) or self.max_decode_stall <= 1.0):
            raise ValueError("engine.max_decode_stall must be a number > 1 or null")
        if self.checkpoint_every not in (None, "auto") and (
                not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1):
            raise ValueError('engine.checkpoint_every must be an integer >= 1, "auto" or null')
        if self.prefill_batch > self.max_running:
            raise ValueError("engine.prefill_batch cannot exceed engine.max_running")
        if self.prefill_group_ratio is not None and self.prefill_group_ratio != "auto" and (
                not isinstance(self.prefill_group_ratio, (int, float)) or self.prefill_group_ratio < 1):
            raise ValueError('engine.prefill_group_ratio must be a number >= 1, "auto" or null')
        if self.first_token_first not in (True, False, "auto"):
            raise ValueError('engine.first_token_first must be true, false or "auto"')
        if self.direct_first_token is not None and self.direct_first_token != "auto" and (
                not isinstance(self.direct_first_token, int) or self.direct_first_token < 1):
            raise ValueError('engine.direct_first_token must be an integer >= 1, "auto" or null')
        if self.first_token_read not in FIRST_TOKEN_READS:
            raise ValueError(f"engine.first_token_read must be one of {FIRST_TOKEN_READS}, got {self.first_token_read!r}")
        if self.cudnn_attention not in (True, False, "auto"):
            raise ValueError('engine.cudnn_attention must be true, false or "auto"')
        if self.switch_interval_ms is not None and (
                not isinstance(self.switch_interval_ms, (int, float)) or not 0.01 <= self.switch_interval_ms <= 100):
            raise ValueError("engine.switch_interval_ms must be a number of ms from 0.01 to 100, or null")
        if self.flat_step not in (True, False, "auto"):
            raise ValueError('engine.flat_step must be true, false or "auto"')
        object.__setattr__(self, "speculative", parse_speculative(self.speculative))
        if not isinstance(self.policy, SchedulingPolicy):
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))

    def for_backend(self, on_cpu: bool) -> "EngineConfig":
        """This config with the "auto" prefill chunk made concrete for the backend (CPU or GPU);
        the other "auto"s are resolved where their inputs are known (scheduler, checkpoints)."""
        if self.prefill_chunk != "auto":
            return self
        return replace(self, prefill_chunk=CPU_PREFILL_CHUNK if on_cpu else GPU_PREFILL_CHUNK)

    def first_token_reads(self, on_cpu: bool) -> str:
        """`first_token_read` made concrete for the backend: "now", "hits" or "next_step"."""
        if self.first_token_read == "auto":
            return "now" if on_cpu else "hits"
        return self.first_token_read

    def flat_steps(self) -> bool:
        """`flat_step` made concrete ("auto": on; the model must also support it)."""
        return self.flat_step in (True, "auto")

    def direct_first_token_limit(self, on_cpu: bool) -> int:
        """Longest uncached prompt rest that gets its first token outside the batch (0: never)."""
        if self.direct_first_token == "auto":
            return self.for_backend(on_cpu).prefill_chunk if on_cpu else 0  # type: ignore[return-value]
        return self.direct_first_token or 0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """Build from plain YAML/JSON values; unknown keys are an error so typos do not pass silently."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown engine settings: {sorted(unknown)}; known: {sorted(known)}")
        values = dict(values)
        if isinstance(values.get("cache"), Mapping):
            values["cache"] = CacheConfig(**values["cache"])
        if "warmup_prompts" in values:
            values["warmup_prompts"] = tuple(values["warmup_prompts"])
        return cls(**values)
