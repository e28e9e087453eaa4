"""The Triton-interpreter launcher judges its child by the child's summary counts, not by words in its output."""
from __future__ import annotations

import pytest

from tests.triton_interpreter import NOT_INTERPRETED_REASON, check_child_summary, summary_counts

GOOD = "....s....\n" + "SKIPPED [1] tests/test_x.py:37: this is the interpreter child\n" + "8 passed, 1 skipped in 3.21s\n"


def test_the_final_summary_line_is_parsed():
    assert summary_counts(GOOD) == {"passed": 8, "skipped": 1}
    assert summary_counts("== 2 failed, 10 passed, 3 skipped, 1 error in 0.50s ==") == \
        {"failed": 2, "passed": 10, "skipped": 3, "error": 1}
    assert summary_counts("no tests ran in 0.01s") == {}


def test_a_child_that_ran_its_checks_passes():
    assert check_child_summary(GOOD, min_passed=8) == {"passed": 8, "skipped": 1}


@pytest.mark.parametrize("stdout", [
    # skipped nearly everything, yet its output contains "passed" and "skipped"
    "s.ssssssss\n1 passed, 8 skipped in 1.02s\n",
    # the interpreted checks skipped because the child did not interpret
    "........\n" + f"SKIPPED [3] tests/test_x.py:50: {NOT_INTERPRETED_REASON} test_x_under_interpreter\n"
    + "8 passed, 3 skipped in 2.00s\n",
    "....F\n1 failed, 8 passed in 2.00s\n",
    "crashed before the summary\n",
])
def test_a_child_that_skipped_failed_or_died_is_refused(stdout):
    with pytest.raises(AssertionError):
        check_child_summary(stdout, min_passed=8)
