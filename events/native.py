"""The one loader of kvroute's optional C extensions.

Each extension has a pure-Python reference that gives the same answers; ``load(name)``
returns the extension module, or None where it is not built (no compiler or headers when
the package was installed) or ``KVROUTE_NO_NATIVE=1`` is set -- the caller then takes its
Python path. The extensions (built by ``pip install -e .``, see pyproject's ext-modules):

* ``events._native`` -- vLLM's chained block hashing (``events.hashing``);
* ``router._refcounts`` -- the speculative store's refcount table
  (``router.prediction.speculative``);
* ``router.index._memindex`` -- the memory index's block table (``router.index.memory``).

``native_paths()`` says which were asked for and which loaded (the router logs it at
start-up); ``KVROUTE_REQUIRE_NATIVE=1`` makes the tests fail rather than skip where one is
missing (``tests/routerkit.need_native``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

__all__ = ["EXTENSIONS", "load", "native", "native_paths"]

EXTENSIONS = ("events._native", "router._refcounts", "router.index._memindex")

_loaded: dict[str, bool] = {}


def load(name: str) -> ModuleType | None:
    """The extension module ``name``, or None (not built, or ``KVROUTE_NO_NATIVE`` set)."""
    mod: ModuleType | None = None
    if not os.environ.get("KVROUTE_NO_NATIVE"):
        try:
            mod = importlib.import_module(name)
        except ImportError:  # not built: the Python path
            mod = None
    _loaded[name] = mod is not None
    return mod


def native_paths() -> dict[str, bool]:
    """Every extension: whether it is loaded (loading the ones nobody asked for yet)."""
    for name in EXTENSIONS:
        if name not in _loaded:
            load(name)
    return dict(_loaded)


native: Any = load("events._native")
