"""The gateway raises its open-file limit at start (`gateway.service.raise_open_file_limit`).

Every connection is a file descriptor: with the usual soft limit of 1,024 a
listener's ``max_connections`` could never be reached.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest

from gateway.service import raise_open_file_limit


@pytest.fixture
def limits() -> Iterator[tuple[int, int]]:
    """The process's open-file limits, put back as they were after the test."""
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield saved
    resource.setrlimit(resource.RLIMIT_NOFILE, saved)


def test_the_soft_limit_is_raised_to_the_hard_limit(limits: tuple[int, int]) -> None:
    """A soft limit below the hard one is raised to it; before and after are reported."""
    _soft, hard = limits
    if hard == resource.RLIM_INFINITY or hard < 2:
        pytest.skip(f"the hard limit ({hard}) leaves no room to lower the soft one")
    lowered = min(hard - 1, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    assert raise_open_file_limit() == (lowered, hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)


def test_nothing_changes_at_the_hard_limit(limits: tuple[int, int]) -> None:
    """At the hard limit already, the limit is reported unchanged."""
    _soft, hard = limits
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no finite hard limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    assert raise_open_file_limit() == (hard, hard)
