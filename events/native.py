"""The optional C extension ``events._native``, loaded once for all its users (block
hashing in ``events.hashing``, the memory index's lookup in ``router.index.memory``).

It is built where a compiler and OpenSSL's headers are found (``pip install -e .``); where
it is not, or ``KVROUTE_NO_NATIVE=1`` is set, ``native`` is None and every user takes its
pure-Python path, which gives the same answers.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["native"]

native: Any = None
if not os.environ.get("KVROUTE_NO_NATIVE"):
    try:
        native = importlib.import_module("events._native")  # a C extension: no stub, Any
    except ImportError:  # not built (no compiler or OpenSSL headers): the Python paths
        native = None
