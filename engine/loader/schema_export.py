"""The JSON Schema of a patchset file (``schemas/patchset.schema.json``), for editors and CI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.schema import Patchset

#: Where the schema is generated, relative to the repository root.
SCHEMA_FILE = "schemas/patchset.schema.json"


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a patchset file, for editors and CI."""
    schema = Patchset.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "patch-engine patchset"
    return schema


def json_schema_text() -> str:
    """:func:`json_schema` as the text of ``schemas/patchset.schema.json`` (sorted keys)."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def write_json_schema(path: str | os.PathLike) -> None:
    """Write :func:`json_schema_text` to ``path``."""
    Path(path).write_text(json_schema_text(), encoding="utf-8")
