"""pytest plugin: the fuzz suite's tally (cases run per engine, configurations refused, violations).

tests/test_fuzz_invariants.py counts into FUZZ; this plugin prints one summary line at the end of any
session that ran fuzz cases:

    fuzz: 1000 cases run: 960 checked clean (generic 91, ...), 25 refused as bad input, 15 stopped by known
          gaps; 0 violations

Register it with `pytest_plugins = ("tests.fuzz_report",)` in tests/conftest.py, or `-p tests.fuzz_report` on
the command line (the Makefile's fuzz target).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FuzzTally:
    cases: Counter = field(default_factory=Counter)     # engine -> generated runs checked
    refused: int = 0                                     # generated configurations the config layer rejected
    known: Counter = field(default_factory=Counter)      # runs stopped by a listed known gap (not violations)
    violations: list[str] = field(default_factory=list)  # first line of each failed check (shrinking included)

    @property
    def total(self) -> int:
        return sum(self.cases.values()) + self.refused + sum(self.known.values()) + len(self.violations)

    def line(self) -> str:
        per = ", ".join(f"{k} {v}" for k, v in sorted(self.cases.items()))
        return (f"fuzz: {self.total} cases run: {sum(self.cases.values())} checked clean ({per}), {self.refused} "
                f"refused as bad input, {sum(self.known.values())} stopped by known gaps; "
                f"{len(self.violations)} violations")


FUZZ = FuzzTally()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not FUZZ.total:
        return
    terminalreporter.write_sep("=", "fuzz invariants")
    terminalreporter.write_line(FUZZ.line())
    for gap, n in FUZZ.known.most_common():
        terminalreporter.write_line(f"  known gap ({n} runs): {gap}")
    for v in FUZZ.violations[:5]:
        terminalreporter.write_line(f"  violation: {v}")
