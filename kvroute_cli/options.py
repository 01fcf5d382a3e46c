"""Commands whose flags mirror a settings type pass them on by name, written once.

A command's parameters are named like the fields of the settings it builds (``kvroute
engine`` -> ``EngineSettings``, ``kvroute up`` -> ``DemoConfig``), so listing ``field=field``
for each of them again would only give the two lists a chance to drift apart.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any


def field_names(target: type | Callable[..., Any]) -> tuple[str, ...]:
    """The keyword names ``target`` takes: a dataclass's fields, a pydantic model's fields
    or a function's parameters."""
    if dataclasses.is_dataclass(target):
        return tuple(f.name for f in dataclasses.fields(target) if f.init)
    model_fields = getattr(target, "model_fields", None)
    if isinstance(model_fields, dict):
        return tuple(model_fields)
    return tuple(inspect.signature(target).parameters)


def fields_from(
    target: type | Callable[..., Any], scope: Mapping[str, Any], **given: Any
) -> dict[str, Any]:
    """Keyword arguments for ``target``: ``given`` (values a command converted or renamed)
    and, for every other name ``target`` takes, the value of that name in ``scope`` (the
    command's ``locals()``) when it has one."""
    out = {name: scope[name] for name in field_names(target) if name in scope}
    unknown = set(given) - set(field_names(target))
    if unknown:
        raise TypeError(f"{getattr(target, '__name__', target)} takes no {sorted(unknown)}")
    out.update(given)
    return out
