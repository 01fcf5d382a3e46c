"""One loader for every C extension (``events.native``): it names each, says which are
loaded, and ``KVROUTE_NO_NATIVE=1`` turns every one off, in every user."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from routerkit import need_native

from events.native import EXTENSIONS, native_paths


def test_every_extension_is_listed_and_loaded_where_built():
    paths = native_paths()
    assert (
        set(paths)
        == set(EXTENSIONS)
        == {
            "events._native",
            "router._refcounts",
            "router.index._memindex",
        }
    )
    for name, ok in paths.items():
        need_native(ok, name)


def test_no_native_turns_off_every_extension_in_every_user():
    code = (
        "from events.native import native_paths; from events.hashing import native_hashing; "
        "from router.prediction.speculative import refcounts_type; from router.index.memory import "
        "MemoryIndex; print(native_paths(), native_hashing(), refcounts_type().__name__, "
        "type(MemoryIndex()._table).__name__)"
    )
    env = {**os.environ, "KVROUTE_NO_NATIVE": "1"}
    cmd = [sys.executable, "-c", code]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    out = done.stdout
    assert "True" not in out.split("}")[0]
    assert out.split("}")[1].split() == ["False", "PyRefCounts", "PyBlockTable"]


async def test_the_router_says_at_start_up_which_paths_are_native(caplog):
    from router.config import RouterSettings
    from router.state import RouterState

    state = RouterState(RouterSettings())
    with caplog.at_level(logging.INFO, logger="router.state"):
        await state.start()
    try:
        line = next(r.getMessage() for r in caplog.records if "native:" in r.getMessage())
        loaded = [n for n, ok in native_paths().items() if ok]
        missing = [n for n, ok in native_paths().items() if not ok]
        assert f"native: {', '.join(loaded) or 'none'};" in line
        assert f"pure Python: {', '.join(missing) or 'none'}" in line
    finally:
        await state.stop()
