"""Create a plugin distribution from plugins/_template/: ``python scripts/new_plugin.py my_feature``
writes ``plugins/my_feature/`` (``--into DIR`` writes ``DIR/my_feature`` instead).

The name is the plugin's entry-point name, its switch (``TITAN_MY_FEATURE``) and the stem of its
package (``titan_my_feature``) and distribution (``titan-my-feature``). Names the registry would
refuse are refused here too: malformed or reserved ones (``titan_plugins.switches.name_problem``)
and, outside this repository's ``plugins/``, the names of the plugins this project ships
(``titan_plugins.manager.FIRST_PARTY``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "plugins" / "_template"


def _core() -> tuple:
    """The core's name rules (this checkout's core when the running python has none)."""
    try:
        from titan_plugins.manager import FIRST_PARTY
        from titan_plugins.switches import name_problem, plugin_switch_var
    except ImportError:
        sys.path.insert(0, str(ROOT))
        from titan_plugins.manager import FIRST_PARTY
        from titan_plugins.switches import name_problem, plugin_switch_var
    return FIRST_PARTY, name_problem, plugin_switch_var


def name_refusal(name: str, into: Path) -> str | None:
    """Why ``name`` cannot be a new plugin's name in folder ``into``, or None when it can.

    A first-party name is only possible in this repository's ``plugins/`` (its home).
    """
    first_party, name_problem, _ = _core()
    problem = name_problem(name)
    if problem is not None:
        return problem
    if name in first_party and into.resolve() != ROOT / "plugins":
        return (
            f"plugin name {name!r} belongs to this project's distribution {first_party[name]} "
            "(the registry would refuse any other distribution claiming it)"
        )
    return None


def render(name: str, target: Path) -> None:
    """Copy the template to ``target``, replacing the placeholders in file names and texts."""
    _, _, switch_var = _core()
    words = {
        "PLUGIN_NAME": name,
        "PLUGIN-DIST": name.replace("_", "-"),
        "PLUGIN_UPPER": switch_var(name).removeprefix("TITAN_"),
    }
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    shutil.copytree(TEMPLATE, target, ignore=ignore)
    for path in sorted(target.rglob("*"), reverse=True):  # children before their folders
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


def main(argv: list[str]) -> int:
    """Create the plugin; print how to install it. Exit 2 for a refused name, 1 if it exists."""
    parser = argparse.ArgumentParser(prog="new_plugin.py", description=__doc__.split("\n")[0])
    parser.add_argument("name", help="entry-point name, lower_snake_case (e.g. my_feature)")
    parser.add_argument("--into", type=Path, default=ROOT / "plugins", help="parent folder")
    args = parser.parse_args(argv)
    refusal = name_refusal(args.name, args.into)
    if refusal is not None:
        print(f"new_plugin.py: {refusal}; choose another name", file=sys.stderr)
        return 2
    target = (args.into / args.name).resolve()
    if target.exists():
        print(f"new_plugin.py: {target} exists already", file=sys.stderr)
        return 1
    render(args.name, target)
    print(f"created {target}")
    print("install it (editable) with the python of the environment that runs Megatron:")
    print(f"    python -m pip install -e {target}")
    if target.parent == ROOT / "plugins":
        print("(in this repository ./scripts/bootstrap.sh installs it into .venv)")
    print(f"then: python -m pytest {target / 'tests'}   and   titan-plugins list")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
