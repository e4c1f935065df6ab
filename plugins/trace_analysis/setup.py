"""Build script: metadata lives in setup.cfg; this adds the optional native scanner.

The scanner (``titan_trace_analysis/_native.c``) is the reader's hot loop in C.  It is optional:
where no C compiler or Python headers are available the install still succeeds and the
pure-Python reader (same results, about 2x the CPU) is used; ``titan-trace --version`` says which.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "titan_trace_analysis._native",
            ["titan_trace_analysis/_native.c"],
            optional=True,  # a failed build warns and installs without it
            extra_compile_args=["-O2", "-Wall"],
        )
    ]
)
