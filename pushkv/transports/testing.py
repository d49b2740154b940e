"""The conformance suite's former module: it is :mod:`pushkv.transports.conformance`
now (this name is kept so that existing imports keep working)."""

from .conformance import *  # noqa: F403
from .conformance import __all__  # noqa: F401
