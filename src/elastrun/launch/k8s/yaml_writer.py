"""YAML out: block style, JSON-quoted strings where a plain scalar could be misread.

Written without a YAML library: every document is JSON-compatible data, and strings are
quoted JSON-style unless they are plainly safe, so no value can be misread (``on``,
``1e3``, ``0755``). PyYAML stays optional.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from elastrun.launch.k8s.manifest import JSON, Doc

__all__ = ["dump_yaml"]

_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9._/-]*")
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"})


def _quote(text: str) -> str:
    """A YAML double-quoted scalar in pure ASCII (JSON's escapes, plus ``\\U`` for
    characters beyond the BMP, which YAML cannot read as JSON's surrogate pairs)."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _scalar(value: JSON) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
            return value
        return _quote(value)
    raise TypeError(f"not a scalar: {type(value).__name__}")


def _lines(value: JSON, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{pad}{_scalar(key)}:"
            if isinstance(item, dict | list) and item:
                out.append(head)
                # Sequences under a mapping key sit at the key's own indentation.
                out.extend(_lines(item, indent if isinstance(item, list) else indent + 2))
            else:
                out.append(f"{head} {_inline(item)}")
        return out
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0][indent + 2 :]}")
                out.extend(inner[1:])
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(value)]


def _inline(value: JSON) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump_yaml(docs: Sequence[Doc]) -> str:
    """Multi-document YAML of JSON-compatible documents, ``---`` before each."""
    parts = ["---\n" + "\n".join(_lines(doc, 0) or ["{}"]) + "\n" for doc in docs]
    return "".join(parts)
