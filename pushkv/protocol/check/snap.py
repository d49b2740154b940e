"""Snapshots of live endpoints: canonical, compact, and cheap to restore.

The checker keeps one working :class:`~.producer.Producer` or
:class:`~.consumer.Consumer` per rank and moves it between states by restoring
a snapshot of its mutable attributes into it, in place. A snapshot is a pickle
of those attributes taken in a *canonical* form -- dictionaries in key order,
timer entries without their sequence numbers, counters and statistics left
out -- so two endpoints that will behave alike give the same bytes. The bytes
are interned: a state of the whole system is then a tuple of small ints (one
per endpoint) plus the world around them.

Immutable objects the endpoints share (rank descriptions, layouts, mapping
assignments, peers) are pickled as references into a registry instead of by
value, which makes snapshots small and restores fast.
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import operator
import pickle
import sys
from collections import OrderedDict
from typing import Any

from ..endpoint import Endpoint
from ..events import Peer
from ..layout import EngineSpec, KVLayout, RankInfo
from ..mapping import Assignment

#: Attributes that never change after construction (or that do not affect
#: behaviour: statistics and the timer sequence counter).
STATIC = frozenset({"_handlers", "info", "peer", "config", "role", "stats", "_seq"})

_SHARED: list[object] = []
_SHARED_INDEX: dict[tuple[type, object], int] = {}


def _shared(i: int) -> object:
    return _SHARED[i]


def _reduce_shared(obj: object) -> tuple[Any, tuple[int]]:
    key = (type(obj), obj)
    i = _SHARED_INDEX.get(key)
    if i is None:
        i = _SHARED_INDEX[key] = len(_SHARED)
        _SHARED.append(obj)
    return _shared, (i,)


def _reduce_member(obj: enum.Enum) -> tuple[Any, tuple[type, str]]:
    return getattr, (type(obj), obj.name)  # restored by a C getattr, not Enum.__call__


_TABLE = copyreg.dispatch_table.copy()
for _t in (Peer, RankInfo, EngineSpec, KVLayout, Assignment):
    _TABLE[_t] = _reduce_shared
#: Record classes: which of their fields may hold dicts to put in order.
_NESTED: dict[type, tuple[str, ...]] = {}


def _register_records() -> None:
    """Pickle the endpoints' mutable records as constructor calls and their enums by
    name: several times faster than the generic dataclass and enum protocols."""
    for module in [m for name, m in sorted(sys.modules.items())
                   if name.startswith(__package__ + ".") and ".check" not in name]:
        for obj in vars(module).values():
            if not isinstance(obj, type) or obj.__module__ != module.__name__:
                continue
            if issubclass(obj, enum.Enum):
                _TABLE[obj] = _reduce_member
            elif dataclasses.is_dataclass(obj) and hasattr(obj, "__slots__"):
                fs = dataclasses.fields(obj)
                if not all(f.init for f in fs) or obj.__dataclass_params__.frozen:  # type: ignore[attr-defined]
                    continue
                get = operator.attrgetter(*(f.name for f in fs))
                many = len(fs) > 1

                def reduce(o: Any, cls: type = obj, get: Any = get, many: bool = many
                           ) -> tuple[type, tuple[Any, ...]]:
                    return cls, (get(o) if many else (get(o),))

                _TABLE[obj] = reduce
                _NESTED[obj] = tuple(f.name for f in fs
                                     if "dict" in str(f.type) or "_" in str(f.type)[:1])


from .. import consumer, producer  # noqa: E402,F401  (the records they use are loaded)

_register_records()


def _sort_dicts(obj: Any) -> None:
    """Put every plain dict reachable through protocol records into key order, in place."""
    t = type(obj)
    if t is dict or t is OrderedDict:
        if t is dict and len(obj) > 1:
            keys = list(obj)
            try:
                order = sorted(keys)
            except TypeError:
                order = sorted(keys, key=repr)
            if order != keys:
                items = [(k, obj[k]) for k in order]
                obj.clear()
                obj.update(items)
        for v in obj.values():
            if type(v) in _NESTED or type(v) is dict:
                _sort_dicts(v)
        return
    names = _NESTED.get(t)
    if names:
        for name in names:
            v = getattr(obj, name)
            if v is not None:
                _sort_dicts(v)


def canonicalize(ep: Endpoint) -> None:
    """Bring ``ep`` to its canonical form, in place, without changing its behaviour.

    Timer entries ``(when, seq, key...)`` lose their sequence number (ties then
    break on the key; a sorted list is a valid heap), and dictionaries go into
    key order (iteration order only orders the actions of one call, which the
    checker's network treats as a set).
    """
    timers = ep._timers
    if timers:
        entries = [(e[0], 0, *e[2:]) for e in timers]
        try:
            ep._timers = sorted(entries)
        except TypeError:  # keys of several types: any fixed order will do
            ep._timers = sorted(entries, key=repr)
    d = ep.__dict__
    for k, v in d.items():
        if k not in STATIC and (type(v) is dict or type(v) is OrderedDict):
            _sort_dicts(v)


class Snapshots:
    """Interned canonical snapshots of a fixed list of working endpoints."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints
        self.blobs: list[bytes] = []
        self.index: dict[bytes, int] = {}
        self.loaded = [-1] * len(endpoints)

    def save(self, i: int) -> int:
        """Canonicalize endpoint ``i`` and return the id of its snapshot."""
        ep = self.endpoints[i]
        canonicalize(ep)
        state = {k: v for k, v in ep.__dict__.items() if k not in STATIC}
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=5)
        p.dispatch_table = _TABLE
        p.dump(state)
        blob = buf.getvalue()
        sid = self.index.get(blob)
        if sid is None:
            sid = self.index[blob] = len(self.blobs)
            self.blobs.append(blob)
        self.loaded[i] = sid
        return sid

    def load(self, i: int, sid: int) -> None:
        """Put endpoint ``i`` in snapshot ``sid`` (nothing to do if it is there)."""
        if self.loaded[i] != sid:
            self.endpoints[i].__dict__.update(pickle.loads(self.blobs[sid]))
            self.loaded[i] = sid

    def invalidate(self, i: int) -> None:
        """Endpoint ``i`` was changed in place: its loaded snapshot is unknown."""
        self.loaded[i] = -1

    @property
    def size(self) -> int:
        return len(self.blobs)
