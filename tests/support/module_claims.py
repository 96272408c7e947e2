"""Two pytest processes share one selection of tests, module by module: each runs a module only once it has claimed
it (a file created with O_EXCL in a directory both are given), one taking the modules from the front and the other
from the back, so neither idles while the other still has modules to go.

`make test` runs its slow tests in one stream and the e2e scenarios, then the light tests, in the other
(scripts/run-tests.sh); which stream ends first depends on the machine. With HYBRIDFLOW_TEST_CLAIMS set (a directory)
and HYBRIDFLOW_TEST_CLAIM_FROM (front or back), pytest's loop runs only the modules this process claims; without
it, pytest runs as always. A module is the unit so that module-scoped fixtures (a shared Ray's workers, a job run
once for several tests) are set up in one process only; the next module is claimed as the current one's last test
starts, so that pytest tears down after it exactly what the next test it will run does not need.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CLAIMS_ENV, FROM_ENV = "HYBRIDFLOW_TEST_CLAIMS", "HYBRIDFLOW_TEST_CLAIM_FROM"
_RAN = pytest.StashKey[int]()  # modules this process ran, for the summary


def module_groups(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """The items in runs of the same module (file), in pytest's order."""
    groups: list[list[pytest.Item]] = []
    for item in items:
        if groups and groups[-1][0].path == item.path:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def claim(claims: Path, module: str) -> bool:
    """True for the one process that creates the module's claim first."""
    try:
        os.close(os.open(claims / (module.replace("/", "__") + ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    claims = os.environ.get(CLAIMS_ENV)
    if not claims or session.config.option.collectonly or session.testsfailed:
        return None  # pytest's own loop (it also reports collection errors)
    direction = os.environ.get(FROM_ENV, "front")
    if direction not in ("front", "back"):
        raise pytest.UsageError(f"{FROM_ENV} is {direction!r}: front or back")
    groups = module_groups(session.items)
    if direction == "back":
        groups.reverse()
    ran = 0  # modules this process claimed

    def next_claimed(start: int) -> int | None:
        nonlocal ran
        for i in range(start, len(groups)):
            if claim(Path(claims), groups[i][0].nodeid.split("::")[0]):
                ran += 1
                return i
        return None

    current = next_claimed(0)
    while current is not None:
        items, following = groups[current], None
        for k, item in enumerate(items):
            if k + 1 < len(items):
                nextitem = items[k + 1]
            else:
                following = next_claimed(current + 1)
                nextitem = groups[following][0] if following is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    session.config.stash[_RAN] = ran
    return True


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if (ran := config.stash.get(_RAN, None)) is not None:
        terminalreporter.write_line(f"module claims ({os.environ.get(FROM_ENV, 'front')}): this process ran {ran} "
                                    "module(s); the other process ran the rest")
