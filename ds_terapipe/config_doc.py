"""The key table of ``docs/configuration.md``, generated from the config model.

What a key of the ``"terapipe"`` section means is written once, in the model: each field's
``Field(description=...)`` in :mod:`ds_terapipe.config`, the text the table shows. The page keeps its prose
hand-written; only the lines between its two markers (:data:`BEGIN` and :data:`END`) are generated, so a key added,
renamed or re-documented in the model reaches the page by ``python -m ds_terapipe.config_doc --write``, and
``--check`` (as ``tests/test_config_doc.py``) fails while the page says something else.

The table has one row per key, nested sections as dotted keys (``profile.slice_lengths``, ``freeze.auto.tolerance``),
in declaration order; a section gets its own row before its keys. The default column shows the field's default as
JSON (``none`` for None, ``{}`` for a section whose keys all have defaults), or ``json_schema_extra={"doc_default":
...}`` where the default is computed (from the schedule, from ``slices``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from pathlib import Path
from typing import Iterator, Optional, Sequence

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .config import TeraPipeConfig

__all__ = ["BEGIN", "END", "PAGE", "config_fields", "render_config_table", "render_configuration_page", "main"]

#: the page the table is written into (in a source checkout)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- generated: config table -->"
END = "<!-- end generated -->"
_FIX = "python -m ds_terapipe.config_doc --write"


def _section(field: FieldInfo) -> Optional[type[BaseModel]]:
    """The model a field nests (``X`` or ``Optional[X]``), else None."""
    kinds = [a for a in (typing.get_args(field.annotation) or (field.annotation, )) if a is not type(None)]
    if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel):
        return kinds[0]
    return None


def config_fields(model: type[BaseModel] = TeraPipeConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key of ``model`` as ``(dotted key, field)``, in declaration order, a section before its keys."""
    for name, field in model.model_fields.items():
        yield prefix + name, field
        nested = _section(field)
        if nested is not None:
            yield from config_fields(nested, f"{prefix}{name}.")


def _default(field: FieldInfo) -> str:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "doc_default" in extra:
        return str(extra["doc_default"])
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "`{}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_config_table() -> str:
    """The markdown table ``| key | default | meaning |`` of the ``"terapipe"`` section, one row per key."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{key}` | {_cell(_default(field))} | {_cell(field.description or '')} |"
             for key, field in config_fields()]
    return "\n".join(rows) + "\n"


def render_configuration_page(page: Path = PAGE) -> str:
    """``page`` with the lines between its markers replaced by :func:`render_config_table`."""
    text = page.read_text(encoding="utf-8")
    head, begin, rest = text.partition(BEGIN + "\n")
    table, end, tail = rest.partition(END + "\n")
    if not begin or not end:
        raise ValueError(f"{page}: no {BEGIN!r} line followed by an {END!r} line around the config table")
    return head + begin + render_config_table() + end + tail


def main(argv: Optional[Sequence[str]] = None, page: Path = PAGE) -> int:
    """``--write``: regenerate the page in place; ``--check``: exit 1 with a diff when it is stale; neither:
    print the generated page."""
    parser = argparse.ArgumentParser(prog="python -m ds_terapipe.config_doc", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {page.name} in place")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {page.name} differs from the model")
    args = parser.parse_args(argv)
    generated = render_configuration_page(page)
    if args.write:
        page.write_text(generated, encoding="utf-8")
        return 0
    if not args.check:
        sys.stdout.write(generated)
        return 0
    current = page.read_text(encoding="utf-8")
    if current == generated:
        return 0
    diff = list(difflib.unified_diff(current.splitlines(), generated.splitlines(), f"{page.name} (on disk)",
                                     f"{page.name} (from the model)", n=0, lineterm=""))
    shown = [line[:200] for line in diff[:40]] + ([f"... {len(diff) - 40} more lines"] if len(diff) > 40 else [])
    print("\n".join(shown + [f"{page.name} is stale: run {_FIX}"]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
