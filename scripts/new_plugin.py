"""Create plugins/<name>/ from plugins/_template/: ``python scripts/new_plugin.py my_feature``
(``--into DIR`` writes ``DIR/<name>`` instead)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    """Copy the template, renaming files and placeholders; refuse bad or taken names."""
    into = ROOT / "plugins"
    if len(argv) == 3 and argv[1] == "--into":
        into, argv = Path(argv[2]), argv[:1]
    if len(argv) != 1 or not re.fullmatch(r"[a-z][a-z0-9_]*", argv[0]) or argv[0] == "plugins":
        print("usage: new_plugin.py NAME [--into DIR]  (lower_snake_case)", file=sys.stderr)
        return 2
    name = argv[0]
    target = into / name
    if target.exists():
        print(f"{target} exists already", file=sys.stderr)
        return 1
    shutil.copytree(ROOT / "plugins" / "_template", target)
    words = {
        "PLUGIN_NAME": name,
        "PLUGIN-DIST": name.replace("_", "-"),
        "PLUGIN_UPPER": name.upper(),
    }
    for path in sorted(target.rglob("*"), reverse=True):
        if path.is_file():
            text = path.read_text()
            for old, new in words.items():
                text = text.replace(old, new)
            path.write_text(text)
        renamed = path.name
        for old, new in words.items():
            renamed = renamed.replace(old, new)
        if renamed != path.name:
            path.rename(path.with_name(renamed))
    print(f"created {target}; install with: .venv/bin/pip install --no-deps -e {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
