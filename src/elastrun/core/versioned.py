"""The common frame of elastrun's JSON files: one object whose ``version`` names its
format, so a reader of another version refuses it in one clear line."""

from __future__ import annotations

import json
from typing import Any


def load_versioned(text: str | bytes, version: int, error: type[Exception]) -> dict[str, Any]:
    """The object ``text`` holds, when it is of ``version``.

    Raises:
        error: not JSON, not an object, or another version (a bool is none).
    """
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error("not a JSON object")
    found = data.get("version")
    if found != version or isinstance(found, bool):
        raise error(f"version {found!r}, this elastrun reads version {version}")
    return data
