"""What the parts of :class:`~.model.Model` (staging, pull) use of the model itself."""

from __future__ import annotations

from typing import Any

from .scope import Scope
from .world import Item, World


class ModelPart:
    """A part of :class:`~.model.Model`: the model provides these."""

    np: int
    p_stride: int
    d_stride: int
    eager: bool
    scope: Scope
    log: list[str] | None

    def _say(self, text: str) -> None:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _run(self, w: World, ids: list[int], i: int, key: tuple[Any, ...],
             call: Any) -> None:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _frame(self, msg: Any) -> bytes:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _k_of(self, action: Any) -> int:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _call(self, k: int) -> tuple[str, dict[str, int]]:  # pragma: no cover - by Model
        raise NotImplementedError

    def _check_dest(self, w: World, item: Item) -> None:  # pragma: no cover - by Model
        raise NotImplementedError
