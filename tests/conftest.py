"""Suite-wide: crash reports of tests that provoke crashes go to a pytest temp dir, not the system one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ethpipe.errors import CRASH_DIR_ENV


@pytest.fixture(autouse=True, scope="session")
def _crash_reports_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CRASH_DIR_ENV, str(tmp_path_factory.mktemp("crash-reports")))
        yield
