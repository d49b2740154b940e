"""Shared set-up of the vLLM tests: import vLLM once, the tiny model, warning filters.

vLLM and torch emit deprecation warnings of their own on import and while
building configurations; the suite turns warnings into errors, so tests of
this directory ignore those categories (pushkv's own code is still checked by
every other test directory).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

VLLM_MISSING: str | None
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch  # noqa: F401
        import vllm  # noqa: F401
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
    VLLM_MISSING = None
except Exception as exc:  # any import failure means: no usable vLLM here
    VLLM_MISSING = f"vLLM cannot be imported ({type(exc).__name__}: {exc})"

_HERE = Path(__file__).parent
_THIRD_PARTY_WARNINGS = (
    "ignore::DeprecationWarning",
    "ignore::PendingDeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning",
    "ignore::ResourceWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            for spec in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, written once per session."""
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    from pushkv.vllm.testing import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
