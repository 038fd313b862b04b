"""A model family (docs/extending.md): Mistral, Llama's decoder under its
own HF model_type. Importing this module registers it; model.path may
then name a Mistral checkpoint. Its weights carry Llama's names
(model.layers.N.self_attn.q_proj, ...), which the base Family maps.
"""

from __future__ import annotations

from megatron_rl.models.arch import fail
from megatron_rl.models.families import FAMILIES
from megatron_rl.models.families.base import DENSE_DEFAULTS, Family


class Mistral(Family):
    model_type = "mistral"
    architectures = ("MistralForCausalLM",)
    # transformers' MistralConfig defaults for keys config.json may omit
    defaults = {**DENSE_DEFAULTS, "max_position_embeddings": 4096 * 32}
    tiny_config = {"sliding_window": None}

    def check(self, cfg: dict, source: str) -> None:
        super().check(cfg, source)
        window = cfg.get("sliding_window")
        # a window covering every position is full attention
        if window and window < cfg["max_position_embeddings"]:
            raise fail(source, f"sliding_window={window} is not supported "
                               "by megatron's local attention (Mistral-7B-"
                               "v0.3 has null)")


FAMILIES.setdefault(Mistral.model_type, Mistral())
