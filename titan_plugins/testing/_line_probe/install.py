"""The child-process probe of the ``line_independent`` guard (``titan_plugins.testing.line_guard``),
run at interpreter start (from this folder's ``sitecustomize`` and from the test venv's
``titan_line_probe.pth``): on the process's first import of megatron, write one record (the
command) into the folder named by ``_TITAN_LINE_PROBE_DIR``. It only watches: the import goes on
as usual. Standard library only; never raises."""


def _install() -> None:
    import os
    import sys

    records = os.environ.get("_TITAN_LINE_PROBE_DIR")
    if not records or getattr(sys, "_titan_line_probe", False):
        return  # off, or already installed (reached both through the .pth and a sitecustomize)
    sys._titan_line_probe = True

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


try:
    _install()
except Exception:  # a probe of the test session must never break the interpreter
    pass
