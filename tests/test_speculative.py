"""Speculative decoding in the own step (engine/speculative.py, engine/step_runner.py): the same
greedy tokens, log-probabilities and endings as without it, whatever the proposals; the sampled
acceptance rule keeps the target distribution; the policy pieces on their own."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.config import EngineConfig
from engine.runner import Runner
from engine.sampling import make_decoding
from engine.speculative import Adaptive, PromptLookup, SpecConfig, accepted, parse_speculative
from engine.step_runner import StepRunner
from engine.types import SamplingParams
from modelio.cpu_llama import accelerate
from test_step_runner import Job, assert_same, drive

SPEC = SpecConfig(max_tokens=6)


@pytest.fixture(scope="module", params=["mlx_lm", "cpu_fast"])
def model(request, tiny_model_dir):
    """mlx-lm's llama (verification in a padded forward of every decoding row) and the CPU
    fast-path blocks (each verifying row a part of the flat forward)."""
    loaded = mlx_lm.load(str(tiny_model_dir))[0]
    if request.param == "cpu_fast":
        assert accelerate(loaded) > 0
    return loaded


def spec_runner(spec=SPEC, seen: dict | None = None):
    seen = {} if seen is None else seen

    def make(model, config):
        runner = StepRunner(model, EngineConfig(**{**config.__dict__, "speculative": spec}))
        seen["runner"] = runner
        return runner
    return make


def plain(model, config):
    return StepRunner(model, EngineConfig(**{**config.__dict__, "speculative": "off"}))


def echo_jobs(model, seed: int, n: int = 6, spread: int = 20) -> list[Job]:
    """Prompts that hold their own greedy continuation: a random start, what the model says after
    it, and the start again, so prompt lookup proposes long runs that are mostly accepted (and
    rejected where the context makes the model say something else)."""
    rng = random.Random(seed)
    vocab = model.args.vocab_size
    starts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    said = drive(model, plain, [Job(s, 30) for s in starts])
    return [Job(s + j.tokens + s, rng.randrange(5, 60), rng.randrange(0, spread)) for s, j in zip(starts, said)]


def counts(runner) -> tuple[int, int]:
    c = runner.counters()
    return c["spec_proposed_tokens"], c["spec_accepted_tokens"]


def test_echo_prompts_match_without_speculation_and_accept_most(model):
    jobs = echo_jobs(model, seed=0)
    seen: dict = {}
    ours = drive(model, spec_runner(SPEC, seen), jobs)
    assert_same(ours, drive(model, Runner, jobs))
    proposed, taken = counts(seen["runner"])
    print("spec", proposed, taken)
    assert proposed > 0 and taken > proposed * 0.3, (proposed, taken)
