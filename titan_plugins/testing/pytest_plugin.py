"""pytest fixtures for tests that run tasks on gloo worker pools (enabled by the root conftest).

``gloo_pool1`` / ``gloo_pool2`` / ``gloo_pool4`` are session-scoped ``GlooWorkerPool``s of 1, 2 and
4 processes. They are created on first request only, spawn their workers at once in the background
(``start()`` does not wait, so the ~7 s megatron import overlaps with the test's own set-up), and
are closed at the end of the session. Tasks start with ``tiny_gpt.init_parallel(...)``.

The ``line_independent`` marker claims that a test imports no megatron and starts no process that
does (``scripts/test.sh`` runs such a test on one Megatron line only); every run of a marked test
checks the claim and fails the test where it does not hold (``line_guard``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_plugins.testing import line_guard
from titan_plugins.testing.workers import GlooWorkerPool

_RECORDS = pytest.StashKey[Path]()  # the session's folder of child-process megatron records
_CHECK = pytest.StashKey[tuple]()  # per marked test: (guard block, guard, records before)


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers (``multiprocess``: tests that use gloo worker pools;
    ``line_independent``: checked below) and arm the child-process probe of the guard."""
    config.addinivalue_line(
        "markers", "multiprocess: runs tasks in gloo worker processes (gloo_pool* fixtures)"
    )
    config.addinivalue_line(
        "markers",
        f"{line_guard.MARKER}: imports no megatron and starts no process that does (checked)",
    )
    config.stash[_RECORDS] = line_guard.start_child_probe()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's record folder (its children's records)."""
    records = config.stash.get(_RECORDS, None)
    if records is not None:
        shutil.rmtree(records, ignore_errors=True)


def _marked(item: pytest.Item) -> bool:
    return item.get_closest_marker(line_guard.MARKER) is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Hide megatron from a marked test, from its set-up to its teardown."""
    if _marked(item):
        block = line_guard.megatron_hidden(item.nodeid, Path(item.config.rootpath))
        guard = block.__enter__()
        records = line_guard.child_records(item.config.stash[_RECORDS])
        item.stash[_CHECK] = (block, guard, records)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Put megatron back once a marked test's teardown has run."""
    yield
    check = item.stash.get(_CHECK, None)
    if check is not None:
        check[0].__exit__(None, None, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A marked test that reached megatron, in its process or a child's, fails at teardown
    with what it reached and how to fix it (whatever the test itself concluded)."""
    outcome = yield
    check = item.stash.get(_CHECK, None)
    if call.when != "teardown" or check is None:
        return
    _, guard, before = check
    records_dir = item.config.stash[_RECORDS]
    new = line_guard.child_records(records_dir) - before
    module = getattr(item, "module", None)
    problems = []
    if module is not None and line_guard.holds_megatron(module):
        problems.append("its module imports megatron at its top")
    if guard.attempts:
        problems.append(f"it reached {', '.join(sorted(set(guard.attempts)))}")
    if new:
        detail = line_guard.describe_records(records_dir, new)
        problems.append(f"it started processes that imported megatron:\n{detail}")
    if problems:
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is marked {line_guard.MARKER}, but " + "; ".join(problems) + "\n"
            f"A test that reaches megatron can fail differently on each Megatron line: remove "
            f"the {line_guard.MARKER} marker so that it runs on every line."
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
