"""Interpreter-start probe of the ``line_independent`` guard (``titan_plugins.testing.line_guard``):
on a process's first import of megatron, write one record (the command) into the folder named by
``TITAN_TEST_LINE_PROBE_DIR``, then chain to the ``sitecustomize`` this file shadows. Never
raises; it only watches (the import goes on as usual)."""


def _install() -> None:
    import os
    import sys

    records = os.environ.get("TITAN_TEST_LINE_PROBE_DIR")
    if not records:
        return

    class _Probe:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "megatron" or name.startswith("megatron."):
                sys.meta_path.remove(self)  # one record a process: the first import says it
                try:
                    with open(os.path.join(records, str(os.getpid())), "w") as out:
                        out.write(" ".join([sys.executable, *sys.argv]))
                except OSError:
                    pass  # the session ended and took its folder: nothing left to tell
            return None

    sys.meta_path.insert(0, _Probe())


def _chain() -> None:
    # the same walk as entrypoints/_site/sitecustomize.py (titan-run's), which stays stdlib-only
    # and self-contained so a broken titan install never stops a user's own sitecustomize
    import os
    import runpy
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry, "sitecustomize.py") if entry else ""
        if candidate and os.path.abspath(entry) != here and os.path.isfile(candidate):
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
