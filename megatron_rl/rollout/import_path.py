"""`package.module:name` import paths given in the config (data.reward, rollout.agent)."""

from __future__ import annotations

import importlib
from typing import Any


def import_path(key: str, value: str, path: str, error: type[Exception]) -> tuple[str, str, Any]:
    """(module name, attribute, the attribute or None) for `path` = 'package.module:name', the value of config `key`;
    a module that does not import raises `error` naming the key, the module and PYTHONPATH."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"{key}={value!r}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH?") from None
    return module_name, attr, getattr(module, attr, None)


__all__ = ["import_path"]
