"""A random-weight mlx-lm model directory that servers can load: for the HTTP runs on a lent GPU.

    python -m benchmarks.device.device_serve_model smollm2 /tmp/models/smollm2   # SmolLM2-135M's shape, bf16
    python -m benchmarks.device.device_serve_model 1b /tmp/models/llama1b        # the 1.04B llama, bf16
    python -m benchmarks.device.device_serve_model smollm2-mini /tmp/m --dtype float32   # CPU dry runs

The device machine has no network, so no checkpoint: weights are random (seeded), in bf16 as a GPU
serves them, with a byte-level BPE tokenizer of exactly the model's vocabulary (device_models.py)
and a ChatML template, so Pomona, mlx_lm.server and the bare loop all build the same prompts.
Outputs are held at length by the benchmark client (`ignore_eos` / an EOS logit bias).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.device.device_models import CONTEXT, MODEL_1B, MODEL_TINY, SPECIALS, build_tokenizer

# SmolLM2-135M-Instruct's shape (the default model): 30 layers, hidden 576, 9/3 heads, 49,152 tied vocabulary.
MODEL_SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0)
# SmolLM2's vocabulary (so the same tokenizer and token counts as "smollm2"), two narrow layers: for dry runs
# of the device scripts on a CPU.
MODEL_SMOLLM2_MINI = dict(MODEL_SMOLLM2, hidden_size=192, num_hidden_layers=2, intermediate_size=384,
                          num_attention_heads=3, num_key_value_heads=1)
SHAPES = {"smollm2": MODEL_SMOLLM2, "smollm2-mini": MODEL_SMOLLM2_MINI, "1b": MODEL_1B, "tiny": MODEL_TINY}
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(shape_name: str, out: Path, dtype_name: str = "bfloat16", seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    shape = dict(SHAPES[shape_name])
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": CONTEXT, **shape}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype_name))
    mx.eval(model.parameters())
    save_model(out, model)
    tokenizer = build_tokenizer(shape["vocab_size"], seed, out)
    eos = tokenizer.convert_tokens_to_ids(SPECIALS[1])
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype_name, "eos_token_id": eos,
                                                 "bos_token_id": tokenizer.convert_tokens_to_ids(SPECIALS[0])}))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    print(build(args.shape, Path(args.out), args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
