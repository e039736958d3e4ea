"""Print the requirements a transformers release (installed under TARGET) needs and this environment lacks.

Usage: python .ci/matrix_deps.py TARGET. Reads TARGET's transformers METADATA and prints, one per
line, each core requirement (no extras) that the environment seen with TARGET first on the path
does not satisfy, e.g. ``tokenizers<=0.23.0,>=0.22.0`` for transformers 5.6 beside tokenizers 0.23.3.
.ci/matrix installs exactly those into TARGET, so the suite's venv (torch, fla, liger) is shared
and only what differs per release is installed per release.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def main(target: str) -> int:
    sys.path.insert(0, target)
    dist = next(Path(target).glob("transformers-*.dist-info"))
    needed = []
    for line in (dist / "METADATA").read_text(encoding="utf-8").splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = metadata.distribution(req.name).version
        except metadata.PackageNotFoundError:
            found = None
        if found is None or found not in req.specifier:
            needed.append(f"{req.name}{req.specifier}")
    print("\n".join(needed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
