"""The fault suite: crashes at every step, byte damage of every file kind,
protocol fuzzing, a full disk and EIO. Every family records its cases here and
one summary line per family is printed at the end of the run:

    fault family crash/save: 12 cases tried, 12 held, 0 failed

Bounded for CI (2 cores): each family samples its cases; ``KVOFFLOAD_FAULTS=full``
runs every step and every byte instead (minutes to hours).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

FULL = os.environ.get("KVOFFLOAD_FAULTS") == "full"


@dataclass
class Family:
    name: str
    tried: int = 0
    held: int = 0
    failures: list[str] = field(default_factory=list)

    def case(self, what: str, ok: bool, detail: str = "") -> None:
        self.tried += 1
        if ok:
            self.held += 1
        else:
            self.failures.append(f"{what}: {detail}")

    def line(self) -> str:
        return (
            f"fault family {self.name}: {self.tried} cases tried, {self.held} held, "
            f"{len(self.failures)} failed"
        )

    def check(self) -> None:
        """Fail the test with every failed case, after all were tried."""
        assert self.tried, f"{self.name}: no case was tried"
        assert not self.failures, "\n".join([self.line(), *self.failures[:20]])


FAMILIES: dict[str, Family] = {}


def family(name: str) -> Family:
    return FAMILIES.setdefault(name, Family(name))


@pytest.fixture
def fam(request: pytest.FixtureRequest) -> Iterator[Family]:
    """The family of this test (its name minus ``test_``, plus its parameters)."""
    name = request.node.name.removeprefix("test_").replace("[", "/").rstrip("]")
    f = family(name)
    yield f


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FAMILIES:
        terminalreporter.section("fault families")
        for f in FAMILIES.values():
            terminalreporter.write_line(f.line())
