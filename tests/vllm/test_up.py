"""``pushkv up`` on this host, and the CPU recipe's model speaking text and chat.

For the module, ``pushkv up`` runs the CPU recipe (prefill on core 0, decode on
core 1, the proxy in front), with a plain vLLM server (no KV connector, the same
model and tokenizer) beside it as the reference. With the ``openai`` client:

* text completions (plain words, words of the vocabulary, token ids) and chat
  completions, streamed and not, through ``pushkv up``'s proxy answer exactly
  what the plain server answers, and the decode server received every prompt
  token over the connector (vLLM's ``prompt_tokens_by_source``);
* bad flags end ``pushkv up`` with one line and exit status 2, before it starts
  anything;
* SIGINT (Ctrl-C) stops the proxy and both servers, and no process of theirs is
  left (the module's last test).
"""

from __future__ import annotations

import os
import signal
import socket
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

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from pushkv.cli import main  # noqa: E402
from pushkv.vllm.testing import (  # noqa: E402
    CHAT_ROLES,
    PROCESS_GROUP,
    Server,
    ServerSpec,
    free_port,
    get_text,
    metric,
    stop_group,
)
from pushkv.vllm.up import TINY_MODEL_NAME, Command  # noqa: E402
from pushkv.vllm.up import Up as Deployment  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 900  #: generous: three servers start at once on two shared cores


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    out: Path
    logs: Path
    proxy: str
    prefill: str
    decode: str

    def printed(self) -> str:
        return self.out.read_text(errors="replace")


def wait(cond, timeout_s: float, what) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    logs = tmp_path_factory.mktemp("up-logs")
    ports = {k: free_port() for k in ("port", "prefill-port", "decode-port")}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = logs / "up.out"
    argv = [sys.executable, "-m", "pushkv.cli", "up", "--tiny-model-dir", str(tiny_model),
            "--log-dir", str(logs)] + [f"--{k}={v}" for k, v in ports.items()]
    with out.open("wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    u = Up(proc, out, logs, f"http://127.0.0.1:{ports['port']}",
           f"http://127.0.0.1:{ports['prefill-port']}",
           f"http://127.0.0.1:{ports['decode-port']}")
    try:
        wait(lambda: "pushkv up: ready" in u.printed() or proc.poll() is not None, STARTUP_S,
             lambda: f"pushkv up not ready:\n{u.printed()[-3000:]}")
        assert proc.poll() is None, u.printed()[-3000:]
        yield u
    finally:
        if proc.poll() is None:
            stop_group(proc, signal.SIGINT, timeout_s=120)


@pytest.fixture(scope="module")
def plain(tiny_model: Path, up: Up, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Server]:
    """The reference: the same model and tokenizer, no connector (after ``up`` is ready:
    at most three servers start at once)."""
    logs = tmp_path_factory.mktemp("up-plain")
    server = Server(ServerSpec(model=str(tiny_model), port=free_port(), cpu=1, tokenizer=True,
                               extra_args=("--served-model-name", TINY_MODEL_NAME)),
                    logs / "plain.log")
    with server:
        server.wait_healthy(STARTUP_S)
        yield server


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


def complete(url: str, prompt: str | list[int], stream: bool) -> tuple[str, int | None]:
    """(text, prompt tokens) of a greedy completion, through the openai client."""
    c = client(url)
    if not stream:
        r = c.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=12,
                                 temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens if r.usage else None
    chunks = c.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=12,
                                  temperature=0, stream=True)
    return "".join(ch.choices[0].text for ch in chunks if ch.choices), None


def chat(url: str, messages: list[dict[str, str]], stream: bool) -> str:
    c = client(url)
    if not stream:
        r = c.chat.completions.create(model=TINY_MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                      max_tokens=12, temperature=0)
        assert r.choices[0].message.role == "assistant"
        return r.choices[0].message.content or ""
    chunks = c.chat.completions.create(model=TINY_MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=12, temperature=0, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


PROMPTS: list[str | list[int]] = [
    "w5 w6 w7 w8 w9 w10",
    "Hello, pushkv: plain English is all <unk> to this model w17",
    " ".join(f"w{(7 * i) % 990 + 5}" for i in range(70)),  # three blocks of 32, and more
    [11, 18, 25, 32, 39, 46],
]
CHATS = [
    [{"role": "user", "content": "w5 w6 w7"}],
    [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "w100 w101"}, {"role": "user", "content": "w102"}],
]


def test_up_printed_where_each_listens(up):
    text = up.printed()
    for name, url in (("prefill", up.prefill), ("decode", up.decode), ("proxy", up.proxy)):
        assert any(line.split()[2:4] == [name, url] for line in text.splitlines()
                   if line.startswith("pushkv up:")), text
    assert get_text(up.proxy + "/health")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_completions_through_up_equal_a_plain_server(up, plain, stream):
    for prompt in PROMPTS:
        got, want = complete(up.proxy, prompt, stream), complete(plain.url, prompt, stream)
        assert got == want, prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_through_up_equals_a_plain_server(up, plain, stream):
    for messages in CHATS:
        got = chat(up.proxy, messages, stream)
        assert got and got == chat(plain.url, messages, stream), messages


def test_the_chat_template_marks_roles_with_words_of_the_vocabulary(plain):
    """What the model sees of a chat: ``<s> ROLE CONTENT </s>`` per message, the role a
    word of the vocabulary, then the assistant's opening."""
    r = client(plain.url).chat.completions.create(
        model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "w9 hello"}],
        max_tokens=1, temperature=0)
    assert r.usage is not None
    # <s> w4 w9 <unk> </s> <s> w5
    assert r.usage.prompt_tokens == 7 and CHAT_ROLES["user"] == 4


def decode_tokens(up: Up) -> tuple[float, float]:
    """Prompt tokens the decode server received over the connector, and computed."""
    text = get_text(up.decode + "/metrics")
    return (metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
            metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute"))


def test_the_decode_server_received_every_prompt_token_over_the_connector(up, plain):
    received0, computed0 = decode_tokens(up)  # the proxy's discovery computed a token
    complete(up.proxy, "w301 w302 w303 w304 w305", False)
    chat(up.proxy, [{"role": "user", "content": "w306 w307"}], True)
    received, computed = decode_tokens(up)
    assert (received - received0, computed - computed0) == (5 + 7, 0)


#: a process that waits, doing nothing, until a signal ends it
IDLE = (sys.executable, "-c", "import signal; signal.pause()")


class _Idle(ServerSpec):
    """A server's spec whose process only waits: how it is started, not what it runs."""

    def argv(self) -> list[str]:
        return list(IDLE)


def test_each_process_starts_in_a_group_of_its_own_in_the_callers_session(tmp_path):
    """``PROCESS_GROUP``: ``pushkv up`` and the harness's servers start each process in a
    process group of its own (it stops with its children) but in the caller's session:
    where the kernel shares the CPUs among sessions first (``sched(7)``, autogroup), a
    deployment is one group. Each process had a session of its own before."""
    assert PROCESS_GROUP == 0
    up = Deployment([], log_dir=str(tmp_path / "logs"))
    up.start(Command("prefill", IDLE))
    server = Server(_Idle(model="m", port=free_port()), tmp_path / "server.log").start()
    procs = [up.procs["prefill"], server.proc]
    try:
        for proc in procs:
            assert proc is not None
            assert os.getpgid(proc.pid) == proc.pid  # a group of its own: killpg reaches all
            assert os.getsid(proc.pid) == os.getsid(0)  # in the caller's session
    finally:
        server.stop(5)
        stop_group(up.procs["prefill"], signal.SIGKILL)


def test_bad_flags_end_up_with_one_line_and_status_2(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for argv, said in (
                (["--port", "0"], "not a port"),
                (["--port", "8100", "--prefill-port", "8100"], "each process needs its own"),
                (["--vllm-args", "--kv-transfer-config {}"], "set by pushkv up"),
                (["--vllm-args", "'unclosed"], "shell-quoted"),
                (["--decode-cpus", "one"], "list of device numbers"),
                (["--startup-timeout", "-1"], "above 0"),
                (["--frobnicate"], "unrecognized arguments"),
                (["--prefill-port", str(busy)], f"port {busy} (prefill) is in use")):
            with pytest.raises(SystemExit) as exc:
                main(["up", "--tiny-model-dir", str(model), *argv])
            assert exc.value.code == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("pushkv up: error:"), err
            assert said in err, (argv, err)


def group_members(pgids: set[int]) -> list[int]:
    """Live processes whose process group is one of ``pgids``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def test_sigint_stops_everything_and_leaves_no_process(up, plain):
    """Last in the module: it ends ``pushkv up``."""
    me = psutil.Process(up.proc.pid)
    tree = [me, *me.children(recursive=True)]
    pgids = {os.getpgid(p.pid) for p in tree}
    assert len(pgids) == 4, tree  # pushkv up's own group, and one per process it started
    # one session, pushkv up's: one task group where the kernel groups by session
    assert {os.getsid(p.pid) for p in tree} == {os.getsid(up.proc.pid)}, tree
    assert len(tree) >= 6, tree  # at least each server's engine core besides its API server
    os.kill(up.proc.pid, signal.SIGINT)  # what Ctrl-C sends
    assert up.proc.wait(180) == 0, up.printed()[-3000:]
    wait(lambda: not group_members(pgids), 60,
         lambda: f"left behind: {group_members(pgids)}")
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in tree)
    assert "SIGINT: stopping proxy, decode, prefill" in up.printed()
    for url in (up.proxy, up.prefill, up.decode):
        with pytest.raises(OSError):
            get_text(url + "/health", timeout=5)
