"""When the step that samples a prompt's first token is read back (`engine.first_token_read`).

Every step is read while the next one runs, so a first token normally leaves one step after the
step that sampled it. "now" reads that step at once (any prompt's), "hits" only for a prefix hit's
(a restored prefix at least as long as the rest it fed), "next_step" never. The tokens must be
the same whichever is chosen; only the step in which the first token leaves changes.
"""

from __future__ import annotations

import random

import mlx_lm
import pytest

from engine.batch_generator import BatchGeneratorRunner as Runner  # mlx-lm's: the reference
from engine.config import EngineConfig
from engine.sampling import make_decoding
from engine.step.step_runner import StepRunner
from engine.types import SamplingParams
from modelio.cpu_llama import accelerate
from test_step_runner import Job, assert_same, drive, prefix_cache

MODES = ("now", "hits", "next_step")


@pytest.fixture(scope="module", params=["mlx_lm", "cpu_fast"])
def model(request, tiny_model_dir):
    loaded = mlx_lm.load(str(tiny_model_dir))[0]
    if request.param == "cpu_fast":
        assert accelerate(loaded) > 0
    return loaded


def stepper(mode: str, on_cpu: bool):
    def make(model, config):
        return StepRunner(model, EngineConfig(**{**config.__dict__, "first_token_read": mode}), on_cpu=on_cpu)
    return make


def calls_to_first_token(model, mode: str, on_cpu: bool, prefix: int) -> tuple[int, int]:
    """(the call whose progress ends the prompt, the call whose output holds its first token) for
    a 40-token prompt fed in chunks of 16 beside a decoding request; `prefix` of it restored."""
    runner = StepRunner(model, EngineConfig(model="tiny", prefill_chunk=16, first_token_read=mode), on_cpu=on_cpu)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    runner.insert("busy", [5, 6, 7], [], None, make_decoding(params, 3, []), 50)
    for _ in range(3):
        runner.step()
    prompt = [random.Random(1).randrange(1, model.args.vocab_size) for _ in range(40)]
    cache = prefix_cache(model, prompt[:prefix]) if prefix else None
    runner.insert("new", prompt[prefix:], prompt[:prefix], cache, make_decoding(params, 40, []), 50)
    ended = first = None
    for call in range(1, 10):
        progress, generated = runner.step()
        if any(p.request_id == "new" and p.end_of_prompt for p in progress):
            ended = call
        if first is None and any(g.request_id == "new" for g in generated):
            first = call
    assert ended is not None and first is not None
    return ended, first


@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu-step", "gpu-step"])
def test_a_first_token_leaves_in_the_step_that_ends_its_prompt_where_the_setting_says(model, on_cpu):
    cold, hit = 0, 32  # a hit: 32 restored, 8 fed
    for mode, cold_late, hit_late in (("now", 0, 0), ("hits", 1, 0), ("next_step", 1, 1)):
        ended, first = calls_to_first_token(model, mode, on_cpu, cold)
        assert first - ended == cold_late, (mode, "cold")
        ended, first = calls_to_first_token(model, mode, on_cpu, hit)
        assert first - ended == hit_late, (mode, "hit")


@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu-step", "gpu-step"])
@pytest.mark.parametrize("mode", MODES)
def test_the_tokens_are_mlx_lms_whenever_a_first_token_is_read(model, on_cpu, mode):
    """Prefix hits, cold prompts, one-token requests, stops and aborts arriving at random steps."""
    rng = random.Random(7)
    vocab = model.args.vocab_size
    jobs = []
    for i in range(12):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 90))]
        jobs.append(Job(prompt, rng.choice([1, 2, rng.randrange(3, 30)]), rng.randrange(0, 25),
                        abort=rng.choice([None, None, rng.randrange(5, 40)]),
                        stop=(rng.randrange(1, vocab),) if i % 4 == 0 else (),
                        prefix=rng.randrange(1, len(prompt)) if i % 2 == 0 else 0))
    reference = drive(model, Runner, jobs)
    assert_same(drive(model, stepper(mode, on_cpu), jobs, prefill_chunk=16), reference)


def test_auto_reads_at_once_on_the_cpu_and_for_prefix_hits_on_gpus():
    config = EngineConfig(model="tiny")
    assert config.first_token_reads(on_cpu=True) == "now"
    assert config.first_token_reads(on_cpu=False) == "hits"
    assert EngineConfig(model="tiny", first_token_read="next_step").first_token_reads(on_cpu=False) == "next_step"
    with pytest.raises(ValueError, match="first_token_read"):
        EngineConfig(model="tiny", first_token_read="soon")
