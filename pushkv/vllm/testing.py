"""Run real vLLM servers with ``PushKVConnector`` on one machine, for tests and benchmarks.

* :func:`write_tiny_llama` -- a tiny random ``LlamaForCausalLM`` (no download):
  2 layers, 2 attention heads, 1 KV head, head_dim 64, vocabulary 1000, weights
  drawn from a seeded generator, saved as ``config.json`` + ``model.safetensors``,
  with the word tokenizer and chat template of :func:`write_word_tokenizer`.
* :class:`ServerSpec` / :class:`Server` -- the command line, environment and
  life of one ``vllm.entrypoints.openai.api_server`` process (CPU recipe:
  ``--enforce-eager``, block size 32, token-id prompts without a tokenizer).
* :func:`post_json`, :func:`get_text`, :func:`metric` -- tiny stdlib HTTP helpers.
* :data:`CPU_TUNING`, :data:`SPIN_S` -- the directory whose ``sitecustomize`` caps
  vLLM's busy loops (``ServerSpec(spin_s=...)`` puts it on the server's path; see
  ``cpu_tuning/sitecustomize.py``), and the cap every server of a run gets.

Servers run in their own process group, in the caller's session
(:data:`PROCESS_GROUP` says why), and are always stopped (SIGINT, then
SIGKILL) by :meth:`Server.stop` or the context manager.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The ``process_group`` each process of a one-host deployment starts in (servers,
#: proxy, router; ``subprocess.Popen``): a process group of its own (0: numbered by its
#: pid), so that it stops with all its children (``os.killpg``), in the session of the
#: process that starts it. Not a session of its own: where the kernel groups processes
#: by session (the autogroup feature of ``sched(7)``, on unless the kernel was booted
#: with ``noautogroup``), each session is a task group that shares the CPUs as one, its
#: weight on a core following the share of its load there (``calc_group_shares`` in
#: the kernel's ``kernel/sched/fair.c``). With a session a server, a 2-core machine
#: under load left processes without a core for hundreds of milliseconds at a time, and
#: a pair's mean TTFT was 1.3-2.1 times what it is in one session, from 2 to 24 QPS
#: (docs/validation/2026-12-06-sim-saturation.md, "One session").
PROCESS_GROUP = 0


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
}


#: First on ``PYTHONPATH`` of a vLLM server: its ``sitecustomize`` tunes vLLM for a small
#: CPU machine, each fix switched on by an environment variable (see the file).
CPU_TUNING = Path(__file__).with_name("cpu_tuning")
#: The variable that caps vLLM's shared-memory busy loop (seconds), read by CPU_TUNING.
SPIN_ENV = "PUSHKV_BENCH_SPIN_S"
#: The variable that has CPU_TUNING record each engine step and model run as a timeline
#: span (with a timeline directory; off when unset).
SPANS_ENV = "PUSHKV_BENCH_SPANS"
#: How long every vLLM server of a run may busy-loop on its shared-memory queues after a
#: message (seconds, a string for the environment; vLLM's own: 1 s).
SPIN_S = "0.002"


#: A variant with 2 KV heads, so that tensor parallelism 2 splits them (TP 1 <-> TP 2).
TINY_LLAMA_2KV = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32}


def write_tiny_llama(path: str | os.PathLike[str], seed: int = 0,
                     config: dict[str, Any] | None = None, tokenizer: bool = True) -> Path:
    """Write the tiny random Llama (or ``config``, e.g. :data:`TINY_LLAMA_2KV`) to
    ``path`` (idempotent for a given seed), with its word tokenizer and chat template
    (:func:`write_word_tokenizer`) unless ``tokenizer`` is false."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config or TINY_LLAMA
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    weights = {"model.embed_tokens.weight": normal(vocab, h, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = normal(vocab, h, std=0.2)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer:
        write_word_tokenizer(out, vocab_size=vocab)
    return out


#: The tiny model's chat template (Jinja, as Hugging Face tokenizers carry it): every
#: message is ``<s> ROLE CONTENT </s>``, where the role is a word of the vocabulary
#: (:data:`CHAT_ROLES`); the generation prompt opens the assistant's message. A content
#: given as a list of parts is its text parts joined by spaces.
#: The words (token ids) that mark each role's messages in :data:`CHAT_TEMPLATE`.
CHAT_ROLES = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
CHAT_TEMPLATE = (
    "{%- set roles = " + json.dumps({r: f"w{i}" for r, i in CHAT_ROLES.items()}) + " -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in roles -%}"
    "{{ raise_exception('unknown role ' ~ m['role'] ~ ': one of " + ", ".join(CHAT_ROLES)
    + "') }}"
    "{%- endif -%}"
    "{%- if m['content'] is string -%}{%- set text = m['content'] -%}"
    "{%- elif m['content'] is none -%}{%- set text = '' -%}"
    "{%- else -%}{%- set text = m['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join(' ') -%}"
    "{%- endif -%}"
    "{{ '<s> ' ~ roles[m['role']] ~ ' ' ~ text ~ ' </s> ' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<s> " + f"w{CHAT_ROLES['assistant']}" + " ' }}"
    "{%- endif -%}"
)


def write_word_tokenizer(path: str | os.PathLike[str],
                         vocab_size: int = TINY_LLAMA["vocab_size"]) -> Path:
    """Give the tiny model a tokenizer and a chat template: word ``w<i>`` is token ``i``.

    Tokens 0-2 are ``<unk>``, ``<s>``, ``</s>``; any other word (plain English
    included) reads as ``<unk>``. Text is words separated by spaces, so decoding
    and re-encoding any id sequence gives it back, which is what ``vllm bench
    serve``'s random dataset needs. The chat template (:data:`CHAT_TEMPLATE`, in
    ``tokenizer_config.json``) lets ``/v1/chat/completions`` serve the model.
    Built with the ``tokenizers`` package: nothing is downloaded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    return out


#: the ports :func:`free_port` handed out in this process (never handed out twice)
_HANDED_OUT: set[int] = set()
#: the lowest port :func:`free_port` picks
_FIRST_PORT = 10000
#: Linux's default ``ip_local_port_range``, where the file cannot be read
_EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for implicit binds (outgoing connections, port 0)."""
    try:
        lo, hi = (int(x) for x in
                  Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return lo, hi


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, for a server started later.

    Not one the kernel picks for port 0: those are ephemeral ports, and until the
    server binds it any outgoing connection on the host (another server's HTTP
    client, a ZMQ socket) may take it as its local port -- vLLM's NIXL side channel
    then dies with 'Address already in use' and its engine never becomes healthy.
    So a random port below the ephemeral range (:func:`ephemeral_ports`), where
    nothing is bound implicitly, that binds now and that this process has not handed
    out before; where the range leaves no room below it, the kernel's pick."""
    lo, _ = ephemeral_ports()
    rng = random.SystemRandom()
    below = lo - _FIRST_PORT >= 1000  # room for random picks below the range
    for _ in range(1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rng.randrange(_FIRST_PORT, lo) if below else 0))
            except OSError:  # bound by someone else now
                continue
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1")


def kv_transfer_config(role: str, engine_id: str, side_channel_port: int | None = None,
                       policy: str = "fail", **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of a ``PushKVConnector`` instance on this host (no port:
    every rank binds a free one)."""
    if side_channel_port is not None:
        extra["side_channel_port"] = side_channel_port
    return {
        "kv_connector": "PushKVConnector",
        "kv_connector_module_path": "pushkv.vllm.connector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }


@dataclass(kw_only=True)
class ServerSpec:
    """How to start one vLLM server on the tiny model (CPU recipe)."""

    model: str
    port: int
    kv_config: Mapping[str, Any] | None = None
    cpu: int | None = None  #: core for the server's OpenMP threads
    block_size: int = 32
    max_model_len: int = 256
    kv_cache_gib: float = 1
    tokenizer: bool = False  #: serve with the model's tokenizer (token-id prompts otherwise)
    prefix_caching: bool = True
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    #: Cap vLLM's busy loop at this many seconds (e.g. :data:`SPIN_S`; None: vLLM's 1 s).
    spin_s: str | None = None

    def argv(self) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
            "--enforce-eager", "--disable-hybrid-kv-cache-manager", "--seed", "0",
        ]
        if not self.tokenizer:
            args.append("--skip-tokenizer-init")
        if not self.prefix_caching:
            args.append("--no-enable-prefix-caching")
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
                "PYTHONUNBUFFERED": "1"}
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        root = str(Path(__file__).resolve().parents[2])  # so every vLLM process finds pushkv
        paths = [root, env.get("PYTHONPATH")]
        if self.spin_s is not None:
            env[SPIN_ENV] = self.spin_s
            paths.insert(0, str(CPU_TUNING))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        return env | dict(self.env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ServerError(RuntimeError):
    """A server did not come up (the message ends with its log's tail)."""


class Server:
    """One vLLM server process, logging to ``log_path``."""

    def __init__(self, spec: ServerSpec, log_path: str | os.PathLike[str]) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(self.spec.argv(), env=self.spec.environ(),
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         process_group=PROCESS_GROUP)
        finally:
            log.close()
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"server on port {self.spec.port} exited\n{self.tail()}")
            with contextlib.suppress(OSError):
                if get_text(self.url + "/health", timeout=2) is not None:
                    return self
            time.sleep(0.5)
        raise ServerError(f"server on port {self.spec.port} not healthy after {timeout_s} s\n"
                          f"{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # Worker processes of the group may outlive the parent for a moment.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """Kill the whole server at once (a crash, not a shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(120)  # a loaded machine can take a while to reap a whole server

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: Server, timeout_s: float = 180.0) -> Iterator[tuple[Server, ...]]:
    """Start servers together, wait until all are healthy, stop them all at the end."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(timeout_s)
        yield servers
    finally:
        for s in servers:
            s.stop()


# ------------------------------------------------------------------ HTTP


def stop_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
               timeout_s: float = 10.0) -> None:
    """Stop a process started in its own process group (:data:`PROCESS_GROUP`) and all
    its children: ``sig`` to the group, then SIGKILL if it has not ended in ``timeout_s``."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout_s / 2)


def post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
    """POST JSON; (status, parsed body or text). Never raises for HTTP errors."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def poll(read: Any, done: Any, timeout_s: float, interval_s: float = 0.2) -> Any:
    """Call ``read()`` until ``done(value)`` holds or ``timeout_s`` passes; the last
    value either way, so the caller's assertion shows what was seen."""
    end = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > end:
            return value
        time.sleep(interval_s)


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed completion's body, line by line (``data: {...}``;
    ``[DONE]`` and other lines skipped)."""
    for raw in lines:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def stream_token_ids(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> list[int]:
    """POST a streamed ``/v1/completions`` request; the token ids of every event.
    Asserts a 200 answer and no error event."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    got: list[int] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        for event in sse_events(resp):
            assert "error" not in event, event
            got += event["choices"][0].get("token_ids") or []
    return got


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode(errors="replace"))


def wait_up(url: str, what: str, timeout_s: float = 60.0) -> None:
    """Return once ``url``/health answers; RuntimeError naming ``what`` after ``timeout_s``
    (a router or stand-in server a benchmark started)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            get_text(url + "/health", timeout=5)
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"{what} did not come up at {url}") from None
            time.sleep(0.2)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# ------------------------------------------------------ proxy and router


def start_proxy(prefill: str, decode: str, log: Path,
                *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``pushkv proxy`` in front of one prefill and one decode server, on a free port,
    in its own process group, with the test's quick timeouts; ``extra``: more flags."""
    port = free_port()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding pushkv
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pushkv.cli", "proxy", "--prefill", prefill, "--decode",
             decode, "--port", str(port), "--timeout", "60", "--health-interval", "0.5",
             "--backoff-max", "1", *extra],
            env=env, stdout=out, stderr=subprocess.STDOUT, process_group=PROCESS_GROUP)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            get_text(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"proxy did not come up: {log.read_text()[-2000:]}")


def stop_proxy(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc, signal.SIGINT)


#: The vLLM project's router (``pip install vllm-router==0.1.17``).
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def start_router(prefills: list[str], decode: str, policy: str, log: Path
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """vllm-router on a free port; tried again on another port if the one picked was
    taken meanwhile (another process may bind it between the pick and the router)."""
    for _ in range(3):
        port = free_port()
        argv = [ROUTER, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--prometheus-port", str(free_port()), "--decode", decode]
        for p in prefills:
            argv += ["--prefill", p]
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    process_group=PROCESS_GROUP)
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            try:
                if "Starting server on 127.0.0.1:" + str(port) in log.read_text():
                    get_text(url + "/health", timeout=5)
                    return proc, url
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    raise AssertionError(f"vllm-router did not come up: {log.read_text()[-2000:]}")


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc)
