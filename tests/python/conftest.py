"""Shared fixtures for the end-to-end tests: paths to the built binary and the embedded model."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELAY = pathlib.Path(os.environ.get("RELAY_BIN", ROOT / "build" / "relay"))
DEMO_MODEL = ROOT / "models" / "relay-demo-moe"
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def relay_bin():
    assert RELAY.exists(), f"{RELAY} not built: run scripts/build.sh"
    return RELAY
