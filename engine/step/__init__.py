"""Pomona's own batched step, one room: `step_runner.py` (the step, `StepRunner`), `backend.py`
(what differs between a CPU's step and a GPU's), `plan.py` (rows in use and the token budget),
`kv_table.py` (the KV table and its views), `rings.py` (a bounded cache's rings), `records.py`
(per-sequence and per-step records), `sampling.py` (the rows' processors and samplers),
`speculative.py` and `draft.py` (proposals the step verifies). From outside, the engine reaches it
only through engine/runner_choice.py (`StepRunner`, `unsupported`) and the speculation settings
engine/config.py parses (`SpecConfig`)."""
