"""Published model shapes with random weights (`jaxspec.load("random:NAME")`): step costs and
memory do not depend on the values, so a machine that cannot fetch a model can still time one
of its shape. Gemma 3 4B is a vision-language model: its shape includes the SigLIP tower."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig, VisionConfig
from jaxspec.errors import UserError

_GEMMA3 = {"arch": "gemma3", "rms_eps": 1e-6, "rope_local_theta": 1e4, "bos_token_id": 2,
           "eos_token_ids": [1]}

SHAPES: dict[str, dict] = {
    "gemma3-270m": {**_GEMMA3, "vocab_size": 262144, "hidden_size": 640, "num_layers": 18,
                    "num_heads": 4, "num_kv_heads": 1, "head_dim": 256,
                    "intermediate_size": 2048, "rope_theta": 1e6, "sliding_window": 512,
                    "layer_types": (["sliding"] * 5 + ["full"]) * 3, "query_scale": 0.0625,
                    "max_position": 32768},
    # google/gemma-3-4b-it's config.json: 34 layers, linear rope scaling 8 on global layers.
    "gemma3-4b": {**_GEMMA3, "vocab_size": 262208, "hidden_size": 2560, "num_layers": 34,
                  "num_heads": 8, "num_kv_heads": 4, "head_dim": 256,
                  "intermediate_size": 10240, "rope_theta": 1e6,
                  "rope_scaling": {"kind": "linear", "factor": 8.0}, "sliding_window": 1024,
                  "layer_types": (["sliding"] * 5 + ["full"]) * 5 + ["sliding"] * 4,
                  "query_scale": 0.0625, "max_position": 131072},
}
VISION: dict[str, VisionConfig] = {
    "gemma3-4b": VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=27,
                              num_heads=16, image_size=896, patch_size=14, tokens_per_image=256,
                              image_token_id=262144, boi_token_id=255999, eoi_token_id=256000),
}


def random_model(name: str, dtype: str = "bfloat16", seed: int = 0, tokenizer=None):
    """A `Model` of the preset `name`'s shape with random weights (std 0.02) in `dtype` (int8:
    quantised from float32; the image side then stays float32)."""
    from jaxspec.images import Preprocess
    from jaxspec.models import vision
    from jaxspec.models.model import Model
    from jaxspec.models.params import init_params
    from jaxspec.models.quant import quantize_params

    if name not in SHAPES:
        raise UserError(f"no preset shape {name!r}; presets: {', '.join(SHAPES)}")
    config = ModelConfig.from_dict(SHAPES[name])
    int8 = dtype == "int8"
    params = init_params(config, jax.random.key(seed), jnp.float32 if int8 else jnp.dtype(dtype))
    tower = None
    if name in VISION:
        vc = VISION[name]
        vp = jax.tree.map(lambda w: w.astype(jnp.float32 if int8 else jnp.dtype(dtype)),
                          vision.init_params(vc, config.hidden_size, jax.random.key(seed + 1)))
        tower = vision.Vision(vc, vp, Preprocess(vc.image_size))
    return Model(config, quantize_params(params) if int8 else params, tokenizer,
                 f"random:{name}", vision=tower)
