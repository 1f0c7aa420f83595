"""A pytest helper: `assert_conforms(case, outputs)` raises AssertionError naming the
worst element (device, row, column, got, expected) when outputs do not conform."""

from __future__ import annotations

from typing import Any


def assert_conforms(case: Any, outputs: Any) -> None:
    """Asserts that `outputs` (per-device arrays or tensors; a dict of them by buffer name
    for cases with several outputs) conform to `case` by the project's rules."""
    from . import check

    result = check(case, outputs)
    if not result.ok:
        raise AssertionError(f"case `{case.name}` does not conform: {result.reason}")
