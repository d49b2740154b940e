"""The wire codec: round trips, and untrusted bytes only ever raise DecodeError."""

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushkv.protocol import (
    Cancel,
    CancelAck,
    DecodeError,
    Fail,
    FailReason,
    Heartbeat,
    Hello,
    Notify,
    ReadDone,
    Register,
    Skip,
    decode,
    encode,
    uniform_ranks,
)
from pushkv.protocol.messages import MAGIC, MAX_FRAME, VERSION

ids = st.text(min_size=1, max_size=40)
attempts = st.integers(0, 2**32 - 1)
ranks = st.integers(0, 1000)

incs = st.integers(0, 2**63 - 1)

messages = st.one_of(
    st.builds(Register, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              producer_engine_id=ids,
              block_ids=st.lists(st.integers(0, 2**31 - 1), max_size=50).map(tuple),
              num_tokens=st.integers(0, 2**20), first_token=st.integers(0, 10),
              window_ms=st.integers(1, 10**9), incarnation=incs),
    st.builds(Cancel, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              final=st.booleans(), incarnation=incs),
    st.builds(CancelAck, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              incarnation=incs),
    st.builds(Fail, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              reason=st.sampled_from(FailReason), detail=st.text(max_size=100),
              incarnation=incs),
    st.builds(Heartbeat, engine_id=ids, rank=ranks,
              transfers=st.lists(st.tuples(ids, attempts, incs), max_size=5).map(tuple)),
    st.builds(Notify, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              incarnation=incs),
    st.builds(ReadDone, transfer_id=ids, attempt=attempts, engine_id=ids, rank=ranks,
              producer_engine_id=ids, incarnation=incs),
    st.builds(Skip, transfer_id=ids, engine_id=ids, rank=ranks, producer_engine_id=ids,
              incarnation=incs),
)


@given(messages)
def test_round_trip(msg):
    frame = encode(msg)
    assert frame[:3] == MAGIC + bytes([VERSION])
    assert decode(frame) == msg
    assert eval(repr(msg)) == msg  # reprs are replayable Python


def test_hello_round_trip():
    info = uniform_ranks("d", tp=2, num_kv_heads=4)[1]
    assert decode(encode(Hello(info=info))) == Hello(info=info)


def test_notification_is_compact():
    frame = encode(Notify(transfer_id="req-0123456789", attempt=3, engine_id="prefill-0", rank=7))
    assert len(frame) < 44  # 37 before the three chunk fields of pipelined packed writes


@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_decode_error(data):
    with contextlib.suppress(DecodeError):
        decode(data)


@given(messages, st.data())
def test_mutated_frames_raise_only_decode_error(msg, data):
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    with contextlib.suppress(DecodeError):
        decode(bytes(frame[:cut]))


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b"", "bad magic"),
        (b"XX\x01\x90", "bad magic"),
        (b"PK\x01" + msgspec.msgpack.encode([7, "t", 0, "e", 0]), "version"),
        (b"PK\x03" + msgspec.msgpack.encode([99, "t"]), "malformed"),
        (b"PK\x03" + msgspec.msgpack.encode([7, "t", -1, "e", 0]), "malformed"),
        (b"PK\x03" + msgspec.msgpack.encode([7, "", 0, "e", 0]), "malformed"),
        (b"PK\x03" + msgspec.msgpack.encode([5, "t", 0, "e", 0, 42, ""]), "malformed"),
        (b"PK\x03" + msgspec.msgpack.encode([2, "t", 0, "e", 0, "p", [-5], 10]), "malformed"),
        (b"PK\x03" + b"\xdd\xff\xff\xff\xff", "malformed"),
        (b"PK\x03" + b"\x91" * 5000, "malformed"),
        (b"PK\x03" + b"\x00" * (MAX_FRAME + 1), "exceeds"),
    ],
)
def test_rejections_say_why(frame, why):
    with pytest.raises(DecodeError, match=why):
        decode(frame)


def test_non_bytes_frame():
    with pytest.raises(DecodeError, match="not bytes"):
        decode(12345)  # type: ignore[arg-type]
