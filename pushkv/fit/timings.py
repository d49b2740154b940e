"""Timing the real parts a CPU profile is made of, on this machine.

* :func:`measure_engine` -- one real vLLM server (the tiny Llama of
  :mod:`pushkv.vllm.testing`): prefill and decode step times from vLLM's own
  per-request metrics (:func:`metric_sums` of ``/metrics``), the request's overhead
  around them, and what an aiohttp relay in front adds;
* :func:`measure_nixl` -- two processes' NIXL agents over UCX on host memory: the
  posting thread's time by descriptor count, completion by descriptors and bytes;
* :func:`measure_side_channel` -- a protocol frame over pyzmq, echoed by another
  process: the sender's, the receiver's time and the one-way latency.

Each returns medians; :mod:`pushkv.fit.measure` runs them and
:mod:`pushkv.fit.cpu_profile` fits the profile to what they return.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cores import CoreProbe
from .cpu_profile import MeasurementError

# ------------------------------------------------------------ engine steps


def metric_sums(text: str) -> dict[str, float]:
    """Every ``vllm:*_sum`` and ``vllm:*_count`` of a ``/metrics`` page, labels summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line):
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _engine_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[f"vllm:{key}_sum"] - before[f"vllm:{key}_sum"]


async def _stream(session: Any, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise MeasurementError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for _ in r.content:
            pass
    return time.perf_counter() - t0


def measure_engine(work: Path, reps: int, lengths: Sequence[int], batches: Sequence[int],
                   decode_input: int, output_len: int) -> dict[str, Any]:
    """Prefill and decode step times, request and relay overhead, on one real server."""
    import aiohttp

    from ..vllm.testing import (
        Server,
        ServerSpec,
        free_port,
        get_text,
        write_tiny_llama,
        write_word_tokenizer,
    )

    model = work / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    max_len = -(-(max(lengths) + output_len + 64) // 256) * 256
    spec = ServerSpec(model=str(model), port=free_port(), cpu=0, tokenizer=True,
                      prefix_caching=False, max_model_len=max_len)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 995) for _ in range(n)]

    def body(n: int, out: int, stream: bool) -> dict[str, Any]:
        return {"model": str(model), "prompt": prompt(n), "max_tokens": out,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    async def run(url: str) -> dict[str, Any]:
        relay_url, stop_relay = await _start_relay(url)
        got: dict[str, Any] = {"overhead": [], "relay": []}
        async with aiohttp.ClientSession() as s:
            for _ in range(4):  # warm-up: first steps, the HTTP path
                await _stream(s, url, body(lengths[0], 2, True))
            # Sizes interleaved, in a fresh order each round: the shared machine's load
            # drifts over seconds, and reaches every size alike.
            steps: dict[int, list[float]] = {n: [] for n in lengths}
            for _ in range(reps):
                for n in rng.sample(list(lengths), len(lengths)):
                    before = metric_sums(get_text(url + "/metrics"))
                    lat = await _stream(s, url, body(n, 1, True))
                    after = metric_sums(get_text(url + "/metrics"))
                    step = _engine_delta(before, after, "request_prefill_time_seconds")
                    steps[n].append(step)
                    got["overhead"].append(lat - step)
            got["prefill"] = {n: statistics.median(v) for n, v in steps.items()}
            for _ in range(reps):  # one relay in front, alternating with direct requests
                direct = await _stream(s, url, body(lengths[0], 1, True))
                relayed = await _stream(s, relay_url, body(lengths[0], 1, True))
                got["relay"].append(relayed - direct)
            per_token: dict[int, list[float]] = {b: [] for b in batches}
            for _ in range(max(2, reps // 2)):
                for b in rng.sample(list(batches), len(batches)):
                    before = metric_sums(get_text(url + "/metrics"))
                    await asyncio.gather(*(_stream(s, url, body(decode_input, output_len, True))
                                           for _ in range(b)))
                    after = metric_sums(get_text(url + "/metrics"))
                    dec = _engine_delta(before, after, "request_decode_time_seconds")
                    per_token[b].append(dec / (b * (output_len - 1)))
            got["decode"] = {b: statistics.median(v) for b, v in per_token.items()}
        await stop_relay()
        return got

    server = Server(spec, work / "logs" / "measure-server.log")
    try:
        server.start()
        server.wait_healthy(600)
        with CoreProbe((0,)) as probe:
            got = asyncio.run(run(server.url))
        return got | {"share": probe.share(0), "wake": probe.wake_s(0),
                      "speed": probe.speed(0),
                      "probe_samples": len(probe.wakes.get(0, ()))}
    finally:
        server.stop()


async def _start_relay(target: str) -> tuple[str, Any]:
    """A streaming aiohttp relay of /v1/completions to ``target`` (what a router adds)."""
    import aiohttp
    from aiohttp import web

    from ..vllm.testing import free_port

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with session.post(target + "/v1/completions", json=body) as r:
            out = web.StreamResponse(status=r.status,
                                     headers={"Content-Type": r.content_type})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    async def stop() -> None:
        await runner.cleanup()
        await session.close()

    return f"http://127.0.0.1:{port}", stop


# ------------------------------------------------------------------ NIXL


def _nixl_target(conn: Any, size: int, delay_us: int) -> None:
    import numpy as np

    from ..transports.nixl.agent import Agent
    from ..transports.nixl.config import NixlConfig
    from ..transports.nixl.memory import KVMemory

    buf = np.zeros(size, np.uint8)
    agent = Agent("measure-target", NixlConfig(progress_delay_us=delay_us))
    mem = KVMemory.from_regions([buf])
    agent.register(mem)
    conn.send((agent.metadata(), mem.bases[0]))
    conn.recv()  # done
    agent.close()


def measure_nixl(reps: int, delay_us: int) -> dict[str, Any]:
    """Posting time by descriptor count; completion by descriptors and bytes."""
    import numpy as np

    from ..transports.nixl.agent import Agent
    from ..transports.nixl.config import NixlConfig
    from ..transports.nixl.memory import KVMemory

    size = 16 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_target, args=(child, size, delay_us), daemon=True)
    proc.start()
    try:
        meta, remote_base = parent.recv()
        src = np.full(size, 7, np.uint8)
        agent = Agent("measure-initiator", NixlConfig(progress_delay_us=delay_us))
        mem = KVMemory.from_regions([src])
        agent.register(mem)
        peer = agent.add_peer(meta)
        local_base = mem.bases[0]

        def descs(base: int, n: int, each: int) -> Any:
            rows = np.zeros((n, 3), np.uint64)
            rows[:, 0] = base + np.arange(n, dtype=np.uint64) * (2 * each)  # not adjacent
            rows[:, 1] = each
            return rows

        def one(n: int, each: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            h = agent.prepare_write(descs(local_base, n, each), descs(remote_base, n, each),
                                    peer, b"", "DRAM")
            state = agent.post(h)
            posted = time.perf_counter()
            while state not in ("DONE", "ERR"):
                state = agent.state(h)
            done = time.perf_counter()
            agent.release(h)
            if state != "DONE":
                raise MeasurementError(f"NIXL WRITE of {n} descriptors ended {state}")
            return posted - t0, done - t0

        for _ in range(20):
            one(1, 8192)  # connection set-up, first registrations
        post_n = (1, 4, 16, 64, 256)
        wire_shape = [(1, 8192), (1, 1 << 16), (1, 1 << 19), (1, 1 << 22),
                      (16, 8192), (64, 8192), (256, 8192)]
        shapes = sorted({(n, 8192) for n in post_n} | set(wire_shape))
        times: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in shapes}
        order = random.Random(1)
        for _ in range(reps * 4):  # interleaved, as the engine's sizes
            for k in order.sample(shapes, len(shapes)):
                times[k].append(one(*k))
        post = [statistics.median(t[0] for t in times[n, 8192]) for n in post_n]
        wire = [statistics.median(t[1] for t in times[k]) for k in wire_shape]
        agent.close()
        parent.send(None)
        return {"post_descriptors": post_n, "post_s": post,
                "wire_descriptors": [n for n, _ in wire_shape],
                "wire_bytes": [n * e for n, e in wire_shape], "wire_s": wire}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------ side channel


def _echo(port: int, back: int, count: int) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{back}")
    for _ in range(count):
        push.send_multipart(pull.recv_multipart())
    push.close(1000)
    pull.close(0)
    ctx.term()


def measure_side_channel(reps: int) -> dict[str, float]:
    """A protocol frame over pyzmq and back: sender's, receiver's time, one-way latency."""
    import zmq

    from ..protocol import Register, decode, encode
    from ..vllm.testing import free_port

    msg = Register(transfer_id="0" * 32, attempt=1, engine_id="decode-0", rank=0,
                   producer_engine_id="prefill-0", block_ids=tuple(range(8)), num_tokens=256,
                   incarnation=12345)
    count = reps * 50
    port, back = free_port(), free_port()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{back}")
    proc = mp.get_context("spawn").Process(target=_echo, args=(port, back, count), daemon=True)
    proc.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    sends, recvs, rtts = [], [], []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            push.send_multipart([b"control", encode(msg)])
            t1 = time.perf_counter()
            if not poller.poll(10_000):
                raise MeasurementError("side channel: no echo within 10 s")
            t2 = time.perf_counter()
            _, frame = pull.recv_multipart()
            decode(frame)
            t3 = time.perf_counter()
            sends.append(t1 - t0)
            recvs.append(t3 - t2)
            rtts.append(t2 - t0)
    finally:
        proc.join(30)
        push.close(0)
        pull.close(0)
        ctx.term()
    send, recv = statistics.median(sends[10:]), statistics.median(recvs[10:])
    # One way: half the round trip the two ends' own times leave (two sends, two receives).
    one_way = max(1e-6, statistics.median(rtts[10:]) / 2 - send - recv)
    return {"message_send_s": send, "message_recv_s": recv, "message_latency_s": one_way}
