"""Raw patchset data before validation: duplicate targets, and the ``extends`` chain merged.

A child's top-level keys override its base's; its patches replace the base's patch with the
same target (or function) in place, or come after. Line origins move with every value, so a
problem in a base file is still reported in that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import PatchsetError
from engine.loader.messages import Origin, Path_, describe, error_at, locate
from engine.loader.names import resolve
from engine.loader.schema_types import literal_values, patch_members
from engine.loader.yaml_lines import MAX_BYTES, parse_yaml, read_text

#: Longest ``extends`` chain.
MAX_EXTENDS = 32
#: Bytes of every file of one ``extends`` chain together: as much as one file may hold. Each file is
#: capped (``MAX_BYTES``), but 32 chained files of 2 MB each ran for minutes and 7.4 GB; a chain's next
#: file is refused by its size, unread, once the chain would pass this.
MAX_CHAIN_BYTES = MAX_BYTES


def _size(path: Path) -> int:
    """A file's size in bytes, 0 where it cannot be read (reading it then says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _default_function(op: Any) -> str | None:
    for member in patch_members():
        field = member.model_fields.get("op")
        if field is not None and op in literal_values(field.annotation):
            function = member.model_fields.get("function")
            if function is not None and isinstance(function.default, str):
                return function.default
    return None


def _raw_patch_key(patch: Any) -> str | None:
    """``patch_key`` of a patch not yet validated: its target, or ``function:`` and its function,
    then its ``when`` range if it has one (a child's patch replaces the base's for the same range)."""
    if not isinstance(patch, dict):
        return None
    when = patch.get("when")
    spec = when.get("transformers") if isinstance(when, dict) else None
    suffix = f" when transformers{spec}" if isinstance(spec, str) and spec else ""
    target = patch.get("target")
    if isinstance(target, str) and target:
        return target + suffix
    function = patch.get("function", _default_function(patch.get("op")))
    if isinstance(function, str) and function:
        return f"function:{function}" + suffix
    return None


def _duplicate_errors(data: dict, origins: dict[Path_, Origin]) -> list[PatchsetError]:
    patches = data.get("patches")
    if not isinstance(patches, list):
        return []
    seen: dict[str, int] = {}
    errors = []
    for index, patch in enumerate(patches):
        key = _raw_patch_key(patch)
        if key is None:
            continue
        if key in seen:
            first = seen[key]
            first_line = locate(("patches", first), origins)[1]
            at = f"patches[{first}]" + (f" (line {first_line})" if first_line else "")
            field = "function" if key.startswith("function:") else "target"
            name = key.split(":", 1)[1] if field == "function" else key
            name = name.split(" when ", 1)[0]
            path: Path_ = ("patches", index) + ((field,) if field in patch else ())
            problem = f"duplicate {field} {name!r}, already patched by {at}; merge them into one patch"
            errors.append(error_at(problem, path, origins))
        else:
            seen[key] = index
    return errors


def _by_prefix(origins: dict[Path_, Origin], n: int) -> dict[Path_, list[tuple[Path_, Origin]]]:
    """Origins grouped by the first ``n`` elements of their path: ``{prefix: [(rest, origin)]}``.

    One pass over the table, so moving every patch's lines in :func:`_merge` is linear in the
    number of lines, not patches times lines (a 5,000-patch child once took minutes).
    """
    groups: dict[Path_, list[tuple[Path_, Origin]]] = {}
    for path, origin in origins.items():
        if len(path) >= n:
            groups.setdefault(path[:n], []).append((path[n:], origin))
    return groups


def _moved(groups: dict[Path_, list[tuple[Path_, Origin]]], old: Path_, new: Path_) -> dict[Path_, Origin]:
    return {new + rest: origin for rest, origin in groups.get(old, ())}


def _merge(
    base: dict, base_origins: dict[Path_, Origin], child: dict, child_origins: dict[Path_, Origin]
) -> tuple[dict, dict[Path_, Origin]]:
    """The child's top-level keys override the base's; patches are the base's, then the child's,
    a child patch replacing in place the base's patch with the same target or function."""
    data: dict[str, Any] = {}
    origins: dict[Path_, Origin] = {(): child_origins.get((), base_origins.get((), (None, None)))}
    base_keys, child_keys = _by_prefix(base_origins, 1), _by_prefix(child_origins, 1)
    for key in list(base) + [k for k in child if k not in base]:
        source, groups = (child, child_keys) if key in child else (base, base_keys)
        data[key] = source[key]
        origins.update(_moved(groups, (key,), (key,)))
    base_patches, child_patches = base.get("patches"), child.get("patches")
    if isinstance(base_patches, list) and isinstance(child_patches, list):
        merged: list[tuple[Any, bool, int]] = [(p, False, i) for i, p in enumerate(base_patches)]
        where: dict[str, int] = {}
        for i, patch in enumerate(base_patches):
            key = _raw_patch_key(patch)
            if key is not None:
                where[key] = i
        for i, patch in enumerate(child_patches):
            key = _raw_patch_key(patch)
            if key is not None and key in where:
                merged[where[key]] = (patch, True, i)
            else:
                if key is not None:
                    where[key] = len(merged)
                merged.append((patch, True, i))
        data["patches"] = [p for p, _, _ in merged]
        origins = {p: o for p, o in origins.items() if p[:1] != ("patches",)}
        origins[("patches",)] = child_origins.get(("patches",), (None, None))
        base_items, child_items = _by_prefix(base_origins, 2), _by_prefix(child_origins, 2)
        for new_index, (_, from_child, old_index) in enumerate(merged):
            groups = child_items if from_child else base_items
            origins.update(_moved(groups, ("patches", old_index), ("patches", new_index)))
    return data, origins


def load_raw(
    data: dict,
    origins: dict[Path_, Origin],
    folder: Path | None,
    chain: list[tuple[Path, str]],
    errors: list[PatchsetError],
    files: list[str | None],
) -> tuple[dict, dict[Path_, Origin]]:
    """Check one file's raw data, then resolve and merge its ``extends`` chain."""
    errors.extend(_duplicate_errors(data, origins))
    if "extends" not in data or data["extends"] is None:
        return data, origins
    parent = data["extends"]
    if not isinstance(parent, str) or not parent:
        raise error_at(
            f"extends must name a bundled patchset or a file, got {describe(parent)}", ("extends",), origins
        )
    try:  # a bare name is bundled; a path is relative to this file; only .yaml/.yml files are read
        path = resolve(parent, relative_to=folder)
    except PatchsetError as exc:
        raise error_at(exc.problem, ("extends",), origins) from None
    real = path
    if any(real == seen for seen, _ in chain):
        names = [shown for _, shown in chain]
        start = next(i for i, (seen, _) in enumerate(chain) if seen == real)
        cycle = " -> ".join(names[start:] + [names[start]])
        raise error_at(f"extends cycle: {cycle}", ("extends",), origins)
    if len(chain) >= MAX_EXTENDS:
        raise error_at(f"extends chain longer than {MAX_EXTENDS} files", ("extends",), origins)
    shown = str(path)
    sizes = [_size(seen) for seen, _ in chain]
    total = sum(sizes) + _size(path)
    if total > MAX_CHAIN_BYTES:
        raise error_at(
            f"the extends chain would read {total:,} bytes in {len(chain) + 1} files ({', '.join(f'{s:,}' for s in sizes)}"
            f", then {_size(path):,} for {shown}), more than {MAX_CHAIN_BYTES:,} bytes for a whole chain; "
            "a patchset and its bases are a few kB, so merge or shorten them", ("extends",), origins)
    files.append(shown)
    base, base_origins = parse_yaml(read_text(path, shown), shown)
    base, base_origins = load_raw(base, base_origins, path.parent, chain + [(real, shown)], errors, files)
    return _merge(base, base_origins, data, origins)
