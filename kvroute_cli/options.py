"""Command-line flags generated from a settings model's fields, written once.

A command built by :func:`settings_command` takes one flag per field of its settings model
(``kvroute router`` -> ``RouterSettings``, ``kvroute engine`` -> ``EngineSettings``,
``kvroute up`` -> ``DemoConfig``), its help, default and bounds read from the field
(``Field(default, ge=, le=, description=)``), so nothing restates them. A section field (a
nested model) contributes one flag per field of its own, ``--<section>-<name>``: the same
name as the flat YAML key ``<section>_<name>`` and the environment variable
``<PREFIX><SECTION>_<NAME>``. A field ending in ``_s`` (seconds) also answers to the flag
without ``-s`` (``--health-interval`` = ``--health-interval-s``). A field may name its flag
itself (``json_schema_extra={"flag": "instance"}``) where vLLM or history spells it so.

Every flag defaults to None, so a command knows which flags were given: those override
the environment and the file underneath them; the others leave them alone
(:func:`load_layered`: YAML < environment < flags, the same layers for every command).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import typer

if TYPE_CHECKING:  # pydantic is imported with the settings models, when a command is built
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

M = TypeVar("M", bound="BaseModel")

__all__ = [
    "Flag",
    "SettingsCommand",
    "config_parameter",
    "deep_merge",
    "field_names",
    "fields_from",
    "load_layered",
    "nested_values",
    "settings_flags",
]


@dataclass(frozen=True, slots=True)
class Flag:
    """One generated flag: the field it sets (``path``), its parameter name and its option."""

    path: tuple[str, ...]
    param: str
    annotation: Any
    option: Any  # a typer.Option


def _plain(annotation: Any) -> tuple[Any, bool]:
    """``annotation`` without ``| None``, and whether it was optional."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _section(annotation: Any) -> type[BaseModel] | None:
    from pydantic import BaseModel

    plain, _ = _plain(annotation)
    return plain if isinstance(plain, type) and issubclass(plain, BaseModel) else None


def _bounds(info: FieldInfo) -> list[tuple[str, Any]]:
    """The field's bounds as (operator, value): ``>=``, ``>``, ``<=``, ``<``."""
    import annotated_types

    out: list[tuple[str, Any]] = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            out.append((">=", m.ge))
        elif isinstance(m, annotated_types.Gt):
            out.append((">", m.gt))
        elif isinstance(m, annotated_types.Le):
            out.append(("<=", m.le))
        elif isinstance(m, annotated_types.Lt):
            out.append(("<", m.lt))
    return out


_HOLDS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": lambda x, b: x >= b,
    ">": lambda x, b: x > b,
    "<=": lambda x, b: x <= b,
    "<": lambda x, b: x < b,
}


def _checked(kind: type, bounds: list[tuple[str, Any]]) -> Callable[[str], Any]:
    """A parser: ``text`` as ``kind``, refused (with the bound) outside ``bounds``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a valid {kind.__name__}") from None
        for op, bound in bounds:
            if not _HOLDS[op](value, bound):
                raise typer.BadParameter(f"{value} is not {op} {bound}")
        return value

    return parse


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise typer.BadParameter(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _default_text(info: FieldInfo) -> str:
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]  # no-arg factories only
    else:
        value = info.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "none"
    return str(value)


def _flag(path: tuple[str, ...], info: FieldInfo) -> Flag:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    name = str(extra.get("flag") or "-".join(path).replace("_", "-"))
    param = "_".join(path)
    plain, _ = _plain(info.annotation)
    notes = [f"default {_default_text(info)}"]
    kwargs: dict[str, Any] = {"show_default": False}
    annotation: Any = str
    if plain is bool:
        names = [f"--{name}/--no-{name}"]
        annotation = bool
    else:
        names = [f"--{name}"]
        if name.endswith("-s") and not name.endswith("-per-s") and not extra.get("flag"):
            names.append(f"--{name[:-2]}")  # seconds: the unit is in the help
        bounds = _bounds(info)
        if typing.get_origin(plain) is Literal:
            choices = tuple(str(a) for a in typing.get_args(plain))
            kwargs.update(parser=_one_of(choices), metavar="|".join(choices))
        elif plain in (int, float) and bounds:
            kwargs.update(parser=_checked(plain, bounds), metavar=plain.__name__.upper())
            notes += [f"{op} {b}" for op, b in bounds]
        elif typing.get_origin(plain) in (list, tuple, dict):
            annotation = list[str]  # repeatable; a mapping's items as the field parses them
            kwargs["metavar"] = "TEXT"
        elif plain in (int, float):
            annotation = plain
        else:
            kwargs["metavar"] = "TEXT"
        # anything else is parsed by the field's validator (JSON, NAME=PATH, ...)
    # Round brackets: typer's rich help would read square ones as markup.
    kwargs["help"] = f"{info.description or ''} ({'; '.join(notes)})".lstrip()
    return Flag(path, param, annotation, typer.Option(None, *names, **kwargs))


def settings_flags(model: type[BaseModel], skip: Iterable[str] = ()) -> list[Flag]:
    """One flag per field of ``model`` (sections: one per field of theirs), ``skip``ped
    names (top-level field names) left out."""
    flags: list[Flag] = []
    skipped = set(skip)
    for name, info in model.model_fields.items():
        if name in skipped:
            continue
        section = _section(info.annotation)
        if section is not None and not _plain(info.annotation)[1]:
            for sub, sub_info in section.model_fields.items():
                flags.append(_flag((name, sub), sub_info))
        else:
            flags.append(_flag((name,), info))
    seen: set[str] = set()
    for f in flags:
        for decl in f.option.param_decls:
            for opt in decl.split("/"):
                if opt in seen:
                    raise ValueError(f"{model.__name__}: two fields answer to {opt}")
                seen.add(opt)
    return flags


def nested_values(flags: Iterable[Flag], values: Mapping[str, Any]) -> dict[str, Any]:
    """The given flags (not None, lists not empty) as a nested mapping of field values."""
    out: dict[str, Any] = {}
    for f in flags:
        value = values.get(f.param)
        if value is None or (isinstance(value, list) and not value):
            continue
        into = out
        for key in f.path[:-1]:
            into = into.setdefault(key, {})
        into[f.path[-1]] = value
    return out


class SettingsCommand:
    """A typer command whose flags are a settings model's fields. It calls ``run(given,
    **rest)`` with ``given`` the flags the user gave, as nested field values, and ``rest``
    the ``extra`` parameters (options that are not settings, e.g. ``--config``).

    ``model`` is a loader: the model's module is imported when typer first reads the
    command's signature, not when ``kvroute_cli`` is imported."""

    def __init__(
        self,
        model: Callable[[], type[BaseModel]],
        run: Callable[..., None],
        *,
        name: str,
        doc: str,
        skip: Iterable[str] = (),
        extra: Iterable[inspect.Parameter] = (),
    ) -> None:
        self._model, self._run, self._skip = model, run, tuple(skip)
        self._extra = list(extra)
        self._flags: list[Flag] | None = None
        self.__name__ = name
        self.__doc__ = doc

    @property
    def flags(self) -> list[Flag]:
        if self._flags is None:
            self._flags = settings_flags(self._model(), self._skip)
        return self._flags

    @property
    def __signature__(self) -> inspect.Signature:
        params = [
            inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=f.option,
                              annotation=f.annotation)
            for f in self.flags
        ]  # fmt: skip
        return inspect.Signature([*params, *self._extra])

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]  # typer reads it
        return {p.name: p.annotation for p in self.__signature__.parameters.values()}

    def __call__(self, **kwargs: Any) -> None:
        rest = {p.name: kwargs.pop(p.name) for p in self._extra}
        self._run(nested_values(self.flags, kwargs), **rest)


def field_names(target: type | Callable[..., Any]) -> tuple[str, ...]:
    """The keyword names ``target`` takes: a dataclass's fields, a pydantic model's fields
    or a function's parameters (for commands whose flags are still written by hand, named
    like the fields of the config they build: the benchmarks)."""
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


def config_parameter() -> inspect.Parameter:
    """The ``--config`` option of a command whose flags are generated (its YAML file)."""
    return inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, help="YAML file with the same settings.", exists=True),
        annotation=Path,
    )


def deep_merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; mappings (sections) are merged key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = deep_merge(out[key], value)
            else:
                out[key] = value
    return out


def _given(flags: Mapping[str, Any]) -> dict[str, Any]:
    """``flags`` without the None values (flags not given), sections included."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, Mapping):
            value = _given(value)
        if value is not None:
            out[key] = value
    return out


def load_layered(
    model: type[M],
    flags: Mapping[str, Any],
    config: Path | None = None,
    *,
    env_prefix: str,
    nest: Callable[[Mapping[str, Any]], dict[str, Any]] = dict,
) -> M:
    """``model`` from YAML ``config`` (lowest) < environment ``<env_prefix><FIELD>`` <
    ``flags`` (highest, only those given: None values are dropped). Every layer uses the
    field names (a section's fields: ``<SECTION>_<NAME>``, or nested); ``nest`` moves a
    layer's flat section names into their sections before the layers are merged.
    Environment values are read as pydantic-settings reads them (JSON for lists, mappings
    and sections)."""
    import yaml
    from pydantic_settings import EnvSettingsSource

    from_file: dict[str, Any] = {}
    if config is not None:
        raw = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{config}: expected a mapping of settings")
        from_file = nest(raw)
    has_sections = any(_section(info.annotation) for info in model.model_fields.values())
    env = EnvSettingsSource(
        model,  # type: ignore[arg-type]  # reads only the fields; a BaseModel serves
        case_sensitive=False,
        env_prefix=env_prefix,
        env_nested_delimiter="_" if has_sections else None,
        env_nested_max_split=1 if has_sections else None,
    )()
    return model(**deep_merge(from_file, nest(env), nest(_given(flags))))
