"""Interpreter-start hook used by ``titan-run``: arm the registry, then chain to the
``sitecustomize`` this file shadows. Never raises."""


def _arm() -> None:
    try:
        from titan_plugins.autoload import arm

        arm("titan-run")
    except Exception as err:  # a broken install must not break the interpreter
        import sys

        print(f"[titan_plugins] WARNING titan-run could not arm: {err}", file=sys.stderr)


def _chain() -> None:
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_titan_chained_sitecustomize", candidate)
            if spec and spec.loader:
                try:
                    spec.loader.exec_module(importlib.util.module_from_spec(spec))
                except Exception as err:
                    print(f"[titan_plugins] chained sitecustomize failed: {err}", file=sys.stderr)
            return


_arm()
_chain()
