"""pytest fixtures for tests that run tasks on gloo worker pools (enabled by the root conftest).

``gloo_pool1`` / ``gloo_pool2`` / ``gloo_pool4`` are session-scoped ``GlooWorkerPool``s of 1, 2 and
4 processes. They are created on first request only, spawn their workers at once in the background
(``start()`` does not wait, so the ~7 s megatron import overlaps with the test's own set-up), and
are closed at the end of the session. Tasks start with ``tiny_gpt.init_parallel(...)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from titan_plugins.testing.workers import GlooWorkerPool


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``multiprocess`` marker (tests that use gloo worker pools)."""
    config.addinivalue_line(
        "markers", "multiprocess: runs tasks in gloo worker processes (gloo_pool* fixtures)"
    )


def _pool(world_size: int) -> Iterator[GlooWorkerPool]:
    pool = GlooWorkerPool(world_size)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def gloo_pool1() -> Iterator[GlooWorkerPool]:
    """A 1-process gloo world (world-size-1 references, isolated from the pytest process)."""
    yield from _pool(1)


@pytest.fixture(scope="session")
def gloo_pool2() -> Iterator[GlooWorkerPool]:
    """A 2-process gloo world shared by the whole session."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def gloo_pool4() -> Iterator[GlooWorkerPool]:
    """A 4-process gloo world shared by the whole session."""
    yield from _pool(4)


@pytest.fixture(autouse=True)
def _fresh_setting_warnings() -> Iterator[None]:
    """Each test sees its own bad-value warnings (the core reports each one once per process)."""
    from titan_plugins import settings

    settings._WARNED.clear()
    yield
