"""``pushkv proxy`` in front of real vLLM CPU servers: what it refuses before any
engine sees it, and which instances it refuses to route to.

A prefill server (``kv_producer``, core 0) and a decode server (``kv_consumer``,
core 1) with PushKVConnector run for the module, with a proxy (the ``pushkv
proxy`` command) in front, and a plain server (no KV connector) beside them.

* The recipe's servers have no tokenizer (``--skip-tokenizer-init``), and vLLM
  checks token ids only with one: a token id past the model's embedding crashes
  an engine that is sent it, so the proxy must refuse it, from the vocabulary
  size the connectors told it.
* A proxy given the plain server as its decode instance refuses it at start (one
  log line naming the fix; ``/health`` says why), and so are instances given in
  the other role.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.testing import (
    PROCESS_GROUP,
    TINY_LLAMA,
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    post_json,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

VOCAB = TINY_LLAMA["vocab_size"]
LENGTH = 256  #: the servers' --max-model-len


class Proxy:
    """``pushkv proxy`` as a subprocess, logging to a file."""

    def __init__(self, log: Path, *argv: str) -> None:
        self.log = log
        self.url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pushkv.cli", "proxy", "--port",
                 self.url.rsplit(":", 1)[1], "--timeout", "60", "--health-interval", "0.5",
                 "--backoff-max", "1", *argv],
                env=env, stdout=out, stderr=subprocess.STDOUT, process_group=PROCESS_GROUP)

    def health(self) -> tuple[int, object]:
        """(status, body) of the proxy's /health; (0, None) while it does not answer."""
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except OSError:
            return 0, None

    def wait_answering(self, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while self.health()[0] == 0:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < end, f"proxy silent: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@dataclass
class Cluster:
    model: str
    prefill: Server
    decode: Server
    plain: Server
    proxy: Proxy
    logs: Path


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-engines-logs")


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, logs: Path) -> Iterator[Cluster]:
    model = str(tiny_model)
    prefill = Server(ServerSpec(model=model, port=free_port(), cpu=0,
                                kv_config=kv_transfer_config("kv_producer", "prefill-0")),
                     logs / "prefill.log")
    decode = Server(ServerSpec(model=model, port=free_port(), cpu=1,
                               kv_config=kv_transfer_config("kv_consumer", "decode-0")),
                    logs / "decode.log")
    plain = Server(ServerSpec(model=model, port=free_port(), cpu=1), logs / "plain.log")
    with running(prefill, decode, plain):
        proxy = Proxy(logs / "proxy.log", "--prefill", prefill.url, "--decode", decode.url)
        try:
            proxy.wait_answering()
            yield Cluster(model, prefill, decode, plain, proxy, logs)
        finally:
            proxy.stop()


def completion(url: str, model: str, prompt: list[int], max_tokens: int = 4
               ) -> tuple[int, dict[str, object]]:
    return post_json(url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=60)


def test_a_token_id_past_the_vocabulary_is_refused_and_no_engine_falls(cluster):
    c = cluster
    assert completion(c.proxy.url, c.model, [5, 6, 7])[0] == 200
    for prompt in ([999999], [5, 6, VOCAB], [[VOCAB + 7]]):
        status, answer = completion(c.proxy.url, c.model, prompt)  # type: ignore[arg-type]
        assert status == 400, answer
        error = answer["error"]
        assert isinstance(error, dict) and "vocabulary" in error["message"], error
        assert error["param"] == "prompt"
    # The whole length is fine; a token more is refused, not shortened.
    assert completion(c.proxy.url, c.model, [5] * (LENGTH - 4), max_tokens=4)[0] == 200
    status, answer = completion(c.proxy.url, c.model, [5] * (LENGTH - 4), max_tokens=5)
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer  # type: ignore[index]
    # Both engines are still up, in the proxy's rotation, and serve: a request through
    # both of them after the refused ones (an engine that had seen one would be gone).
    assert completion(c.proxy.url, c.model, [8, 9, 10])[0] == 200
    assert c.prefill.alive() and c.decode.alive()
    for server in (c.prefill, c.decode):
        get_text(server.url + "/health", timeout=5)
    status, health = c.proxy.health()
    assert status == 200 and all(health["instances"].values()), health  # type: ignore[index]


def requests_answered(log: Path) -> int:
    """HTTP requests a vLLM server logged answering (its access log)."""
    return sum('" 200' in line or '" 503' in line
               for line in log.read_text(errors="replace").splitlines() if "HTTP/1.1" in line)


def lines_naming(log: Path, url: str) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if url in line]


def test_a_decode_server_without_the_connector_is_refused_at_start(cluster):
    c = cluster
    proxy = Proxy(c.logs / "proxy-plain.log", "--prefill", c.prefill.url, "--decode",
                  c.plain.url)
    try:
        proxy.wait_answering()
        status, health = proxy.health()
        assert status == 503, health
        assert isinstance(health, dict) and health["instances"] == {
            c.prefill.url: True, c.plain.url: False}
        why = health["out_of_rotation"][c.plain.url]
        assert "does not run PushKVConnector" in why and '"kv_role":"kv_consumer"' in why
        assert completion(proxy.url, c.model, [5, 6, 7])[0] == 503
        # A few probes more (the plain server logs each request it answers): the
        # refusal is not logged again.
        seen = requests_answered(c.plain.log_path)
        end = time.monotonic() + 60
        while requests_answered(c.plain.log_path) < seen + 3:
            assert time.monotonic() < end, "the proxy stopped probing the refused instance"
            time.sleep(0.1)
        (line,) = [ln for ln in lines_naming(proxy.log, c.plain.url) if "WARNING" in ln]
        assert "--kv-transfer-config" in line and "out of rotation" in line
    finally:
        proxy.stop()


def test_instances_given_in_the_other_role_are_refused(cluster):
    c = cluster
    proxy = Proxy(c.logs / "proxy-swapped.log", "--prefill", c.decode.url, "--decode",
                  c.prefill.url)
    try:
        proxy.wait_answering()
        status, health = proxy.health()
        assert status == 503 and isinstance(health, dict), health
        why = health["out_of_rotation"]
        assert "as kv_consumer, but is given as --prefill" in why[c.decode.url]
        assert "as kv_producer, but is given as --decode" in why[c.prefill.url]
    finally:
        proxy.stop()
    # The module's proxy was not disturbed.
    assert completion(c.proxy.url, c.model, [11, 12, 13])[0] == 200
