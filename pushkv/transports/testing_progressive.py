"""The progressive conformance checks' former module: they are
:mod:`pushkv.transports.conformance.progressive` now (this name is kept so that existing
imports keep working)."""

from .conformance.progressive import *  # noqa: F403
from .conformance.progressive import PROGRESSIVE_CHECKS, chunks, layerwise  # noqa: F401
