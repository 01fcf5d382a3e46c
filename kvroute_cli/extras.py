"""Optional extras: a command that needs one says which instead of an ImportError traceback.

The base install is what a router needs. ``engine`` adds torch (the simulated engine and
its CPU offload tier); ``bench`` adds matplotlib (replay plots), hypothesis (chaos fuzzing)
and the peer routers. Presence is checked with ``find_spec``, which imports nothing, so the
check costs no start-up time.
"""

from __future__ import annotations

import importlib.util

import typer

__all__ = ["EXTRAS", "missing_extras", "require_extras"]

# extra -> the top-level modules it provides (see [project.optional-dependencies]).
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("torch",),
    "bench": ("matplotlib", "hypothesis", "vllm_router", "sglang_router"),
}


def missing_extras(*extras: str) -> list[str]:
    """The extras among ``extras`` with a module that is not installed, in the given order."""
    return [e for e in extras if any(importlib.util.find_spec(m) is None for m in EXTRAS[e])]


def require_extras(command: str, *extras: str) -> None:
    """Exit with status 1 and a one-line install hint when ``command`` lacks an extra."""
    missing = missing_extras(*extras)
    if not missing:
        return
    what = " and ".join(missing) + (" extras" if len(missing) > 1 else " extra")
    typer.echo(f"{command} needs the {what}: pip install 'kvroute[{','.join(missing)}]'", err=True)
    raise typer.Exit(code=1)
