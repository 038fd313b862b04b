"""Model families, one module each, registered by HF model_type.

    family = family_of(hf_config)          # by model_type, else by architectures
    arch = family.parse(hf_config, source)  # what models/hf_config.parse_hf_config does
    FAMILIES["qwen3_moe"].tiny_config       # the tiny random model's config keys

Loading, export, weight sync, the converters, the planner and routing replay
ask the family (or the HFArch it parsed); nothing outside this package checks
a family's name. Adding a family: a module here with one `Family` subclass
(see base.py for what it may refine), listed in `_MODULES`, plus a preset
under configs/models/.

No torch or megatron-core import happens here (the planner runs without them).
"""

from __future__ import annotations

import importlib

from megatron_rl.models.families.base import Family
from megatron_rl.models.arch import fail

_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")


def _load() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for module_name in _MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Family) and value.model_type and value.__module__ == module.__name__:
                if value.model_type in families:
                    raise RuntimeError(f"model_type {value.model_type!r} is registered twice ({module.__name__})")
                families[value.model_type] = value()
    return families


FAMILIES: dict[str, Family] = _load()
"""HF model_type -> its family."""

SUPPORTED = ", ".join(f"{name} ({family.architectures[0]})" for name, family in FAMILIES.items())


def family_of(hf_config: dict, source: str = "config.json") -> Family:
    """The family of a config.json: by model_type, else by a class named in architectures."""
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for family in FAMILIES.values():
        if any(a in family.architectures for a in archs):
            return family
    raise fail(source, f"model_type={model_type!r}, architectures={archs!r} is not supported; supported families: {SUPPORTED}")


def get_family(model_type: str) -> Family:
    """The registered family of an HFArch.family / model_type."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise KeyError(f"no model family {model_type!r} is registered; registered: {sorted(FAMILIES)}") from None


__all__ = ["FAMILIES", "SUPPORTED", "Family", "family_of", "get_family"]
