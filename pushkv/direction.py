"""Which way a transfer's KV moves, chosen by how the request was dispatched.

One rule, used by the vLLM connector (per request) and the simulator (per run):

* **sequential dispatch** (the router sends the decode leg only once the prefill
  leg answered -- vllm-router's PD mode, Dynamo, pushkv's proxy in pull mode):
  the prefill is over before the decode side hears of the request, so a push
  would put a registration round trip and the producer's write on the critical
  path. The decode side **pulls**: its background reader reads the published
  blocks at once.
* **concurrent dispatch** (both legs at arrival -- pushkv's proxy): the decode
  side registers while the prefill computes and the producer **pushes** the
  moment it finishes; the decode leg could not pull, since it is sent before
  the source blocks are known.

``setting`` overrides: ``"push"`` pushes under sequential dispatch too;
``"pull"`` (like ``"auto"``) pulls where a pull can work.
Only the standard library is used.
"""

from __future__ import annotations

DISPATCHES = ("sequential", "concurrent")
SETTINGS = ("auto", "push", "pull")


def choose_direction(dispatch: str, setting: str = "auto") -> str:
    """``"push"`` or ``"pull"`` for a request dispatched ``dispatch``."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if setting not in SETTINGS:
        raise ValueError(f"direction setting must be one of {SETTINGS}, got {setting!r}")
    if dispatch == "concurrent":
        return "push"
    return "push" if setting == "push" else "pull"
