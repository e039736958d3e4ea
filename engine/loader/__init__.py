"""Loading patchsets: files, line numbers, ``extends`` and name resolution.

A patchset is read as bytes, decoded as UTF-8, composed into YAML nodes (never constructed
into Python objects by tag: only plain data is accepted) and built into plain Python values
while a table records the line of every key and list item. That table survives ``extends``
merges, so each problem is reported where it is written, as ``file:line: key: problem``::

    patchsets/x.yaml:12: patches[1].scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'

Every problem of a file is reported at once: the raised :class:`PatchsetError` carries the
first problem's ``file``, ``line`` and ``key``, its ``errors`` attribute lists one
:class:`PatchsetError` per problem, and its text has one line per problem.

A bare name (``qwen3``) is the bundled patchset; anything else is a path, and an existing file
wins over the bundled one (``qwen3.yaml`` is the local copy when there is one); only
``.yaml``/``.yml`` files are ever read (see :func:`resolve`). Loading is linear in the file's size.

One module per job: :mod:`.names` (names and paths), :mod:`.yaml_lines` (YAML with line
numbers), :mod:`.extends` (duplicates and ``extends`` merging), :mod:`.schema_types` and
:mod:`.messages` (pydantic errors rewritten for people), :mod:`.load` (``load_patchset``),
:mod:`.schema_export` (JSON Schema). None of them imports torch (see docs/architecture.md).
"""

from engine.loader.extends import MAX_EXTENDS
from engine.loader.load import load_patchset, patch_location
from engine.loader.names import bundled_dir, bundled_names, resolve
from engine.loader.schema_export import SCHEMA_FILE, json_schema, json_schema_text, write_json_schema
from engine.loader.yaml_lines import MAX_ALIAS_NODES, MAX_BYTES, MAX_DEPTH, MAX_NODES

__all__ = [
    "MAX_ALIAS_NODES",
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_EXTENDS",
    "MAX_NODES",
    "SCHEMA_FILE",
    "bundled_dir",
    "bundled_names",
    "json_schema",
    "json_schema_text",
    "load_patchset",
    "patch_location",
    "resolve",
    "write_json_schema",
]
