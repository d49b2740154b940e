"""End-to-end integrity of pushed KV: a digest per written range, checked by the
consumer before the range counts (the protocol's rule 11, ``CORRUPT``), its
setting, and a fault injector.

Layering: on :mod:`pushkv.protocol` alone (numpy; torch only when handed
tensors); the transports and the vLLM connector use it, the core never does.
"""

from .check import Corruption, Integrity
from .config import DEFAULT_MODE, DEFAULT_SAMPLE_EVERY, MODES, OFF, IntegrityConfig
from .digest import Scope, digest, digest_torch
from .envelope import PullTag, Tag, seal, seal_pull, unseal, unseal_pull
from .inject import KINDS, Injector

__all__ = ["DEFAULT_MODE", "DEFAULT_SAMPLE_EVERY", "KINDS", "MODES", "OFF", "Corruption",
           "Injector", "Integrity", "IntegrityConfig", "PullTag", "Scope", "Tag", "digest",
           "digest_torch", "seal", "seal_pull", "unseal", "unseal_pull"]
