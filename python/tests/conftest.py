"""Shared fixtures: the `cmm` command built beside this package (for the tests that
compare the package with the command)."""

import os
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cmm_bin():
    """The `cmm` binary: $CMM_BIN, else the workspace's release build, else on PATH."""
    candidates = [os.environ.get("CMM_BIN"), str(REPO / "target" / "release" / "cmm"), shutil.which("cmm")]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    if os.environ.get("CI"):
        pytest.fail("CI is set but no `cmm` binary was found (cargo build --release -p cmm-cli)")
    pytest.skip("no `cmm` binary: build it with cargo build --release -p cmm-cli")
