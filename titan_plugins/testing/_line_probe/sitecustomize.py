"""Interpreter-start hook of the ``line_independent`` guard (``titan_plugins.testing.line_guard``)
for children that do not run the test venv's ``.pth`` (fresh venvs get this folder on
``PYTHONPATH``): run the probe (``install.py``), then chain to the ``sitecustomize`` this file
shadows. Never raises."""


def _install() -> None:
    import os
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "install.py"))


def _chain() -> None:
    # the walk of entrypoints/_site/sitecustomize.py (titan-run's), which stays self-contained so
    # a broken titan install never stops a user's own sitecustomize; this one looks only past its
    # own folder, so two shadowing hooks (titan-run's before this) never run each other in turn
    import os
    import runpy
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(entry) if entry else "" for entry in sys.path]
    later = sys.path[entries.index(here) + 1 :] if here in entries else []
    for entry in later:
        candidate = os.path.join(entry, "sitecustomize.py") if entry else ""
        if candidate and os.path.isfile(candidate):
            try:
                runpy.run_path(candidate, run_name="_titan_chained_sitecustomize")
            except Exception as err:
                print(f"[titan_plugins] chained sitecustomize failed: {err}", file=sys.stderr)
            return


try:
    _install()
except Exception:  # a probe of the test session must never break the interpreter
    pass
_chain()
