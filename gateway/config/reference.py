"""The settings reference of ``docs/config.md``, generated from the schema's models.

Every field of :mod:`gateway.config.schema` and of each policy's settings model carries its
type, default and description, so the table is written from them instead of by hand (a test
checks the committed copy is current): ``python -m gateway.config --markdown`` prints it,
``python -m gateway.config --update docs/config.md`` rewrites the block between
:data:`BEGIN_MARK` and :data:`END_MARK`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gateway.config.schema import GatewayConfig


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"\b(gateway|pydantic)\.[\w.]+\.", "", text).replace("NoneType", "null")


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "see below"
    return "`" + json.dumps(value) + "`"


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        sub = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if sub is None:
            for arg in getattr(annotation, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    sub = arg
        item_list = getattr(annotation, "__origin__", None) is list
        if sub is not None and not item_list:
            rows.extend(_rows(sub, f"{path}."))
            continue
        if sub is not None and item_list:
            rows.append((path, "list", _default_text(field), field.description or sub.__doc__.split("\n")[0]))
            rows.extend(_rows(sub, f"{path}[]."))
            continue
        rows.append((path, _type_name(annotation), _default_text(field), field.description or ""))
    return rows


def markdown_reference() -> str:
    """The settings table of docs/config.md: every field, its type, default and meaning."""
    from gateway.routing import registry

    lines = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for path, type_, default, text in _rows(GatewayConfig, ""):
        lines.append(f"| `{path}` | {type_} | {default} | {text} |")
    for name in registry.policy_names():
        model = registry.entry(name).settings_model
        lines += ["", f"**`policy: {name}`** — `policy_settings`:", ""]
        rows = _rows(model, "")
        if not rows:
            lines.append("(none)")
            continue
        lines += ["| setting | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{p}` | {t} | {d} | {x} |" for p, t, d, x in rows]
    return "\n".join(lines) + "\n"


BEGIN_MARK = "<!-- BEGIN GENERATED: python -m gateway.config --markdown -->\n"
END_MARK = "<!-- END GENERATED -->"


def update_reference(path: str | os.PathLike[str]) -> bool:
    """Rewrite the generated block of ``docs/config.md``; True if it changed."""
    text = Path(path).read_text()
    begin = text.index(BEGIN_MARK) + len(BEGIN_MARK)
    end = text.index(END_MARK)
    updated = text[:begin] + markdown_reference() + text[end:]
    if updated != text:
        Path(path).write_text(updated)
    return updated != text


def main(argv: list[str]) -> None:
    """``python -m gateway.config --markdown | --update docs/config.md``."""
    if argv == ["--markdown"]:
        print(markdown_reference(), end="")
    elif argv[:1] == ["--update"] and len(argv) == 2:
        print("updated" if update_reference(argv[1]) else "already current", argv[1])
    else:
        raise SystemExit("usage: python -m gateway.config --markdown | --update docs/config.md")
