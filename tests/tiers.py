"""The two test tiers (a pytest plugin, loaded by tests/conftest.py).

`make test-fast` runs the unit tests alone: `-m "not (fit or subprocess or server or heavy or slow)"`.
`make test` runs everything. A test belongs to the slow tier when it carries one of these marks:

  fit         builds and fits a Composer Trainer (in the test or in a fixture it uses)
  subprocess  starts a process: a CLI under test, `composer -n 2`, a worker pool, DataLoader workers
  server      starts a server process: SeaweedFS (tests/s3_server.py), a Slurm cluster
  heavy       none of these, but takes more than ~1.5 CPU-seconds (a full-size model on the meta
              device, a tiny model trained or exported, a compile): marked by hand, from a measured
              `--durations` of the fast tier (123 functions on 2026-11-29)

Tests are marked from the fixtures they use (FIXTURE_MARKS; fixtures of fixtures count too), or by
hand with `@pytest.mark.fit` etc. An unmarked test that builds a Trainer or starts a process fails with
a message saying which mark it needs, in both tiers, so the fast tier stays fast as tests are added.
(A loopback HTTP server on a thread, tests/convert_fixtures.serve_folder, is no server here: it
starts no process and answers in milliseconds.)
"""

import functools
import multiprocessing.process
import subprocess

import pytest

TIER_MARKS = {
    "fit": "builds and fits a Composer Trainer (excluded by make test-fast)",
    "subprocess": "starts a process: a CLI, a launcher, a worker pool (excluded by make test-fast)",
    "server": "starts a server process: SeaweedFS, Slurm (excluded by make test-fast)",
    "heavy": "a unit test of more than ~1.5 CPU-seconds (excluded by make test-fast)",
}

# Fixtures that fit a trainer or start processes, and the marks a test using them gets.
FIXTURE_MARKS = {
    "tiny_checkpoint": ("fit",),
    "reference_run": ("fit", "subprocess"),
    "mmdit_reference": ("fit", "subprocess"),
    "s3_server": ("server", "subprocess"),
    "slurm": ("server", "subprocess"),
    "lora_run": ("fit",),
    "straight_bucketed_run": ("fit",),
}


def pytest_configure(config):
    for name, description in TIER_MARKS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture in item.fixturenames:
            for mark in FIXTURE_MARKS.get(fixture, ()):
                item.add_marker(mark)


def _in_slow_tier(item) -> bool:
    return any(item.get_closest_marker(name) for name in (*TIER_MARKS, "slow"))


class _Refused(BaseException):
    """A BaseException, so that no `except Exception` in the code under test hides it."""


def _refuse(item, what: str, mark: str, replaced):
    @functools.wraps(replaced)  # keeps the signature, which recipes/config.py reads from Trainer
    def refused(*args, **kwargs):
        raise _Refused(
            f"{item.nodeid} {what} but is not marked: add @pytest.mark.{mark} (or the fixture to "
            "FIXTURE_MARKS in tests/tiers.py), so that make test-fast leaves it out"
        )

    return refused


def _guarded(item):
    """Patches, for the duration of an unmarked test's setup or call, what a unit test must not do."""
    from composer import Trainer

    patch = pytest.MonkeyPatch()
    refusals = [
        (Trainer, "__init__", "builds a Composer Trainer", "fit"),
        (subprocess.Popen, "_execute_child", "starts a subprocess", "subprocess"),
        (multiprocessing.process.BaseProcess, "start", "starts a process", "subprocess"),
    ]
    for owner, name, what, mark in refusals:
        patch.setattr(owner, name, _refuse(item, what, mark, getattr(owner, name)))
    return patch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    patch = None if _in_slow_tier(item) else _guarded(item)
    yield
    if patch:
        patch.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    patch = None if _in_slow_tier(item) else _guarded(item)
    yield
    if patch:
        patch.undo()
