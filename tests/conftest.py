"""Fixtures most test modules share; a module that needs another configuration
defines its own fixture of the same name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from stallfree.core.model.loader import LoadedModel, load_tiny
from tests.server import RunningServer, sim_server, tiny_server


@pytest.fixture(autouse=True)
def structlog_defaults() -> Iterator[None]:
    """A test that runs the CLI in this process configures structlog for the whole
    process (warning level for most commands), which hid later tests' info events."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """The gateway over the simulated engine, one per module."""
    s = sim_server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny() -> Iterator[RunningServer]:
    """The gateway over the tiny random model, one per module."""
    s = tiny_server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_model() -> LoadedModel:
    """The tiny random model itself: weights and tokenizer."""
    return load_tiny()
