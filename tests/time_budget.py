"""The default tier's time budget: a run fails when a test not marked ``slow``
took more than SHADERDSL_TEST_BUDGET seconds (default 10) on the wgpu device,
in its setup, its call or its teardown: each of the durations pytest's
``--durations`` lists (a module or session fixture's setup, torch's import or
a browser's launch, counts as the setup of the first test that uses it).

Why a plugin and not a test: a test cannot see the durations of the tests run
after it, nor those of the other pytest-xdist workers; the plugin reads every
report where ``--durations`` reads them (``report.duration``), in the process
that prints the summary (the xdist controller gets every worker's reports). At
the end of the session it lists the tests over the budget and sets the exit
status to 1; the tests still show as passed, since each one did what it checks.

On by default only where the tier's figures are measured: the wgpu-native
device on Vulkan (lavapipe on CI and on 2 cores here; scripts/test-gpu.sh
turns it off on the H200, whose 14 workers share 16 cores). Dawn
(SwiftShader), the OpenGL backend and the interpreter device
(SHADERDSL_DEVICE=interp) run the same tests at other speeds; set
SHADERDSL_TEST_BUDGET=seconds to check them too, or SHADERDSL_TEST_BUDGET=0 to
turn the check off (a machine busy with other work slows every test alike).
Where the run takes the slow tier too (no ``-m "not slow"``: --full, CI's first
pass) the default is 15 s, since the slow tests' compiles share the cores.
``tests/conftest.py`` registers it; ``-p time_budget`` with tests/ on the path
does elsewhere (tests/test_markers.py)."""
from __future__ import annotations

import os

import pytest

ENV = "SHADERDSL_TEST_BUDGET"
DEFAULT_S = 10.0
# where the slow tier runs too (--full, CI), its long compiles share the two cores with
# the default tier's tests: CI's --full saw one of 8.7 s locally take 10.2 s there
BESIDE_SLOW_S = 15.0


def budget_seconds(environ, beside_slow: bool = False) -> float:
    """The budget in seconds from ``environ``; 0 where the check is off."""
    given = environ.get(ENV, "").strip()
    if given:
        try:
            seconds = float(given)
        except ValueError:
            raise ValueError(f"{ENV} must be a number of seconds (0: no check), "
                             f"got {given!r}") from None
        return max(seconds, 0.0)
    native = environ.get("SHADERDSL_WGPU", "native") != "dawn"
    vulkan = environ.get("SHADERDSL_BACKEND", "Vulkan").lower() == "vulkan"
    on_gpu = environ.get("SHADERDSL_DEVICE", "wgpu") == "wgpu"
    if not (native and vulkan and on_gpu):
        return 0.0
    return BESIDE_SLOW_S if beside_slow else DEFAULT_S


class TimeBudget:
    """Fails the session where a phase of a test not marked slow went over ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.over_budget: list[tuple[float, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.duration > self.seconds and "slow" not in report.keywords:
            self.over_budget.append((report.duration, report.when, report.nodeid))

    def over(self) -> list[tuple[float, str, str]]:
        """(seconds, phase, test id) of each phase over the budget, the slowest first."""
        return sorted(self.over_budget, reverse=True)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.over() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        over = self.over()
        if not over:
            return
        terminalreporter.section(f"over the default tier's {self.seconds:g} s a test",
                                 red=True, bold=True)
        for seconds, phase, test in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {phase:8s} {test}")
        terminalreporter.write_line(
            f"Each test not marked slow must take at most {self.seconds:g} s to set up, to run "
            f"and to tear down ({ENV}): shrink its shapes to the smallest that still catch its "
            f"bug, and move the full ones under @pytest.mark.slow. {ENV}=0 turns the check off "
            f"(a busy machine slows every test).")


def register(config: pytest.Config) -> None:
    """Register the budget where reports are summed: not in an xdist worker
    (its controller gets the reports), and only where the budget is on."""
    seconds = budget_seconds(os.environ, "not slow" not in (config.option.markexpr or ""))
    if seconds and not hasattr(config, "workerinput"):
        config.pluginmanager.register(TimeBudget(seconds), "shaderdsl-time-budget")


def pytest_configure(config: pytest.Config) -> None:
    """Loaded with ``-p time_budget`` (tests/conftest.py calls ``register`` itself)."""
    register(config)
