"""Fixtures of the SGLang tier: a real sidecar process (``kvoffload --dev serve``).

Loaded by pytest in every environment, so nothing here imports SGLang; the
test modules skip themselves without it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ..sidecar_proc import DevSidecar, dev_sidecar


@pytest.fixture(scope="module")
def sidecar() -> Iterator[DevSidecar]:
    pytest.importorskip("kvoffload.sidecar.server")
    with dev_sidecar() as s:
        yield s


@pytest.fixture
def tenant() -> str:
    """A fresh tenant per test: its own salt, so tests never see each other's pages."""
    return f"sgl-{uuid.uuid4().hex[:10]}"
