"""The type checker (mypy, ``[tool.mypy]`` in pyproject.toml, run by scripts/test.sh) covers
``events/`` and ``router/``; an error it is told to ignore names its code (mypy enforces
that: ``ignore-without-code``) and says why, beside it or on the comment line above."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IGNORE = re.compile(r"#\s*type:\s*ignore(\[[a-z0-9-]+(,\s*[a-z0-9-]+)*\])?(.*)$")


def _checked_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["disallow_untyped_defs"] and config["check_untyped_defs"]
    assert config["warn_unused_ignores"] and config["warn_return_any"]
    assert "ignore-without-code" in config["enable_error_code"]
    return list(config["files"])


def test_mypy_covers_events_and_router():
    assert {"events", "router"} <= set(_checked_packages())


def test_every_type_ignore_names_its_code_and_a_reason():
    bad = []
    for package in _checked_packages():
        for path in sorted((REPO / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                m = IGNORE.search(line)
                if m is None:
                    continue
                reason_beside = m.group(3).strip().startswith("#")
                reason_above = i > 0 and lines[i - 1].strip().startswith("#")
                if m.group(1) is None or not (reason_beside or reason_above):
                    bad.append(f"{path.relative_to(REPO)}:{i + 1}: {line.strip()}")
    assert bad == []
