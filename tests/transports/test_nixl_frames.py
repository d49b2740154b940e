"""Side-channel frame tags: any change to an authentic frame fails, every time.

In-process property tests of :mod:`pushkv.transports.nixl.sidechannel.auth` (the
cross-process tests with real sockets are in ``test_nixl_auth.py``).
"""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from pushkv.transports.nixl.sidechannel.auth import Signer, Verifier

KEY = b"0123456789abcdef-pushkv-test-key"
ME = "prefill-0/0"


def _frame(body: bytes) -> tuple[bytes, bytes, bytes]:
    return b"C", body, Signer(KEY, ME).sign(b"C", body)


@given(body=st.binary(max_size=512), data=st.data())
def test_any_truncation_or_extension_fails(body: bytes, data: st.DataObject) -> None:
    kind, body, tag = _frame(body)
    part = data.draw(st.sampled_from(["body", "tag"]))
    cut = data.draw(st.integers(0, len(body) if part == "body" else len(tag) - 1))
    extra = data.draw(st.binary(max_size=4))
    v = Verifier(KEY, ME, window_s=60.0)
    if part == "body":
        changed = body[:cut] + extra
        if changed == body:
            return
        assert not v.check(kind, changed, tag)
    else:
        assert not v.check(kind, body, tag[:cut] + extra[:0])
    assert v.dropped["auth_failed"] == 1 and v.check(kind, body, tag)  # the real one passes


@given(body=st.binary(min_size=1, max_size=256), data=st.data())
def test_any_bit_flip_fails(body: bytes, data: st.DataObject) -> None:
    kind, body, tag = _frame(body)
    frame = bytearray(kind + body + tag)
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] ^= 1 << data.draw(st.integers(0, 7))
    k, b, t = bytes(frame[:1]), bytes(frame[1:1 + len(body)]), bytes(frame[1 + len(body):])
    v = Verifier(KEY, ME, window_s=60.0)
    assert not v.check(k, b, t)
    assert sum(v.dropped.values()) == 1


def test_replays_and_old_frames_fail_and_streams_are_independent() -> None:
    v = Verifier(KEY, ME, window_s=60.0)
    a, b = Signer(KEY, ME), Signer(KEY, ME)
    first = (b"C", b"x", a.sign(b"C", b"x"))
    second = (b"C", b"y", a.sign(b"C", b"y"))
    other = (b"C", b"x", b.sign(b"C", b"x"))
    assert v.check(*second) and not v.check(*first)  # an older counter of the stream
    assert v.check(*other) and not v.check(*other)  # another stream; then its replay
    stale = (b"C", b"z", a.sign(b"C", b"z", timestamp=time.time() - 61))
    ahead = (b"C", b"z", a.sign(b"C", b"z", timestamp=time.time() + 61))
    nan = (b"C", b"z", a.sign(b"C", b"z", timestamp=float("nan")))
    assert not v.check(*stale) and not v.check(*ahead) and not v.check(*nan)
    assert dict(v.dropped) == {"auth_replayed": 2, "auth_stale": 3}
    assert not Verifier(KEY, "prefill-0/1", 60.0).check(*_frame(b"x"))  # another rank's
