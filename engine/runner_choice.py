"""Which `Runner` (engine/runner.py) serves a model: the step `engine_step` names, or mlx-lm's
`BatchGenerator` where the own step cannot run the model.

Apart from the protocol so that neither runner's module imports the other: the engine imports
`make_runner` from here and sees only the protocol it returns.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.batch_generator import BatchGeneratorRunner
from engine.config import EngineConfig
from engine.runner import Runner
from engine.step.step_runner import StepRunner, unsupported

log = logging.getLogger("pomona.engine")

_told: set[str] = set()  # fallback reasons already logged


def make_runner(model: Any, config: EngineConfig) -> Runner:
    """The step `config.engine_step` names; "pomona" falls back to mlx-lm's for models it cannot run."""
    if config.engine_step == "mlx_lm":
        return BatchGeneratorRunner(model, config)
    reason = unsupported(model, config)
    if reason is None:
        try:
            runner = StepRunner(model, config)
            runner.self_check()
            return runner
        except Exception as exc:  # an architecture whose attention does not take the table's views
            reason = f"its forward failed on the batch table ({type(exc).__name__}: {exc})"
    if reason not in _told:
        _told.add(reason)
        log.warning("engine_step pomona cannot run this model: %s; using mlx-lm's BatchGenerator", reason)
    return BatchGeneratorRunner(model, config)
