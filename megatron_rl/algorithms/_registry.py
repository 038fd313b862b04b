"""A name -> function registry whose lookup error lists the valid names (no string if/elif dispatch).

Each registry declares the call its entries must take: a `typing.Protocol` whose
``__call__`` holds the parameters the caller passes (those before ``*`` by
position, those after it by keyword). A user's function given in the config as
an import path `package.module:function` is checked against it when the run
starts (megatron_rl.plugins) and then added under that path, so the callers'
lookups by the config's value find it.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    """Functions registered by name; `kind` names the thing in error messages ("policy loss"), `call` is the
    Protocol whose ``__call__`` is the call every entry must accept (None: the key takes no plug-in)."""

    def __init__(self, kind: str, config_key: str, call: type | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self.call = call
        self._entries: dict[str, F] = {}
        self._plugins: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            return fn

        return decorate

    def add_plugin(self, path: str, entry: F) -> None:
        """Add a user's entry under its import path 'package.module:function' (once checked; a path loaded again
        replaces the earlier entry)."""
        if self.call is None or ":" not in path:
            raise ValueError(f"{self.kind} {path!r}: a plug-in is added under its import path 'package.module:function'")
        self._plugins[path] = entry

    def get(self, name: str) -> F:
        if name in self._entries:
            return self._entries[name]
        if name in self._plugins:
            return self._plugins[name]
        valid = ", ".join(sorted(self._entries))
        if self.call is None:
            raise ValueError(f"unknown {self.kind} {name!r} ({self.config_key}); valid names: {valid}")
        loaded = " (an import path is loaded at start: megatron_rl.plugins.load_plugins(cfg))" if ":" in name else ""
        raise ValueError(
            f"unknown {self.kind} {name!r} ({self.config_key}){loaded}; valid names: {valid}, "
            "or an import path 'package.module:function'"
        )

    def names(self) -> list[str]:
        """The built-in names (plug-ins are not listed)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._plugins
