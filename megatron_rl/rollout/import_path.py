"""`package.module:name` import paths given in the config, imported and checked against the call they must take.

    fn = load_callable("algorithm.loss", "my_pkg.losses:my_loss", PolicyLoss)   # PluginError (a ConfigError) if not

The expected call is a `typing.Protocol` whose ``__call__`` lists the arguments
the caller passes: those before ``*`` by position, those after it by keyword. A
function fits when Python could bind that call to it (`inspect.signature(fn).bind`),
so extra parameters with defaults, ``*args`` and ``**kwargs`` are fine. Every
failure is one line naming the key, the value and the expected call:

    algorithm.loss='my_pkg.losses:my_loss': fn(logprobs, old_logprobs, ...) expected; got my_loss(x)
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from megatron_rl.config.core import ConfigError, is_import_path


class PluginError(ConfigError):
    """An import path in the config names nothing that can be called the way its key is used."""


def protocol_signature(call: type) -> inspect.Signature:
    """``call.__call__``'s signature without ``self``: the call a function of that Protocol receives."""
    signature = inspect.signature(call.__call__)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def describe(signature: inspect.Signature, name: str = "fn", *, returns: bool = True) -> str:
    """'name(a, b, *, c=None) -> T' without the parameters' annotations (the return's kept when `returns`)."""
    shown = signature.return_annotation if returns else signature.empty
    if isinstance(shown, str):  # postponed annotations are text: shown as written, not quoted
        shown = _Written(shown)
    bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                             return_annotation=shown)
    return f"{name}{bare}"


class _Written:
    """An annotation's text, shown as written."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def expected_call(call: type) -> str:
    """The expected call written for an error message: 'fn(a, b, *, c=None) -> T'."""
    return describe(protocol_signature(call))


def load_object(key: str, value: str, expected: str, error: type[Exception] = PluginError) -> Any:
    """The object `value` = 'package.module:name' (config `key`) names; a module that does not import or has no
    such attribute raises `error` naming the key, the value and `expected` (what the key takes)."""
    if not is_import_path(value):
        raise error(f"{key}={value!r}: not an import path 'package.module:name'; {expected} expected")
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"{key}={value!r}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH?") from None
    if not hasattr(module, attr):
        raise error(f"{key}={value!r}: module {module_name!r} has no attribute {attr!r}; {expected} expected")
    return getattr(module, attr)


def check_call(key: str, value: str, fn: Any, call: type, error: type[Exception] = PluginError) -> None:
    """`fn` accepts the call Protocol `call` describes, else `error`: '<key>=<value>: <expected> expected; got ...'."""
    expected = protocol_signature(call)
    found = None
    if not callable(fn):
        found = f"{type(fn).__name__} {fn!r:.60}"
    else:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a readable signature: the call itself will tell
            return
        positional = [p for p in expected.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        keywords = [p.name for p in expected.parameters.values() if p.kind is p.KEYWORD_ONLY]
        try:
            signature.bind(*[None] * len(positional), **dict.fromkeys(keywords))
        except TypeError:
            found = describe(signature, getattr(fn, "__name__", type(fn).__name__), returns=False)
    if found is not None:
        raise error(f"{key}={value!r}: {describe(expected)} expected; got {found}")


def load_callable(key: str, value: str, call: type, error: type[Exception] = PluginError) -> Any:
    """The function `value` names, checked against the Protocol `call` (see the module docstring)."""
    fn = load_object(key, value, expected_call(call), error)
    check_call(key, value, fn, call, error)
    return fn


__all__ = ["PluginError", "check_call", "describe", "expected_call", "is_import_path", "load_callable", "load_object",
           "protocol_signature"]
