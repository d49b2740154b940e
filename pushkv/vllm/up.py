"""``pushkv up``: a prefill server, a decode server and ``pushkv proxy`` on one host.

:func:`commands` gives the three command lines (and the environment each sets)
for a :class:`Plan`; ``pushkv up`` runs them and the deployment files
(``deploy/compose.yaml``, ``deploy/docker/Dockerfile.cpu``) run the very same
lines. With no ``--model`` the plan is the CPU recipe: the tiny random Llama of
:func:`pushkv.vllm.testing.write_tiny_llama` (written to ``--tiny-model-dir`` if
absent, with its word tokenizer and chat template), served by vLLM's CPU build
with one core per server.

``pushkv up`` starts prefill and decode, waits until both answer ``/health``,
starts the proxy, waits until it has both in rotation, prints where each
listens, and then runs until Ctrl-C or SIGTERM (or one of them ends): it stops
the proxy, decode and prefill in that order, each in its own process group
(SIGINT, then SIGKILL after a grace period), so no process of theirs is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from .testing import PROCESS_GROUP

#: The CPU recipe's vLLM flags for the tiny model (docs/vllm.md, CPU recipe).
TINY_MODEL_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--block-size", "32",
                   "--enforce-eager", "--disable-hybrid-kv-cache-manager")
#: The name the tiny model is served under (what clients put in ``model``).
TINY_MODEL_NAME = "tiny-llama"
#: vLLM flags ``pushkv up`` sets itself; ``--vllm-args`` must not repeat them.
OWN_VLLM_FLAGS = ("--model", "--host", "--port", "--kv-transfer-config")
#: The module every vLLM server runs.
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
_CPUS = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``pushkv up`` runs: its flags, resolved."""

    model: str = ""  #: a model path or hub name; empty: the tiny recipe model
    tiny_model_dir: str = TINY_MODEL_NAME  #: where the tiny model lives (written if absent)
    host: str = "127.0.0.1"  #: the proxy's listening address
    port: int = 8000  #: the proxy's port
    prefill_port: int = 8100
    decode_port: int = 8200
    prefill_cpus: str = "0"  #: VLLM_CPU_OMP_THREADS_BIND of prefill ("": not set)
    decode_cpus: str = "1"  #: VLLM_CPU_OMP_THREADS_BIND of decode ("": not set)
    prefill_gpus: str = ""  #: CUDA_VISIBLE_DEVICES of prefill ("": not set)
    decode_gpus: str = ""  #: CUDA_VISIBLE_DEVICES of decode ("": not set)
    vllm_args: tuple[str, ...] = ()  #: more flags for both vLLM servers
    python: str = "python"  #: the interpreter every command runs with

    @property
    def tiny(self) -> bool:
        return not self.model


@dataclass(frozen=True)
class Command:
    """One process of the deployment: its argv, the variables it sets, its URL."""

    name: str  #: prefill, decode or proxy
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    url: str = ""

    def shell(self) -> str:
        """The command as one shell line (variables first)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()),
                         *map(shlex.quote, self.argv)])


def kv_config(role: str, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of one ``PushKVConnector`` server of ``pushkv up``."""
    return {"kv_connector": "PushKVConnector",
            "kv_connector_module_path": "pushkv.vllm.connector",
            "kv_role": role, "engine_id": engine_id}


def commands(plan: Plan) -> list[Command]:
    """Prefill, decode and proxy: the command lines ``pushkv up`` runs for ``plan``
    (and the deployment files run)."""
    model = plan.model or plan.tiny_model_dir
    out = []
    for name, role, port, cpus, gpus in (
            ("prefill", "kv_producer", plan.prefill_port, plan.prefill_cpus, plan.prefill_gpus),
            ("decode", "kv_consumer", plan.decode_port, plan.decode_cpus, plan.decode_gpus)):
        argv = [plan.python, "-m", VLLM_SERVER, "--model", model,
                "--host", "127.0.0.1", "--port", str(port)]
        env: dict[str, str] = {}
        if plan.tiny:
            argv += ["--served-model-name", TINY_MODEL_NAME, *TINY_MODEL_ARGS]
            env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        argv += ["--kv-transfer-config",
                 json.dumps(kv_config(role, f"{name}-0"), separators=(",", ":")),
                 *plan.vllm_args]
        out.append(Command(name, tuple(argv), env, f"http://127.0.0.1:{port}"))
    proxy = (plan.python, "-m", "pushkv.cli", "proxy", "--prefill", out[0].url,
             "--decode", out[1].url, "--host", plan.host, "--port", str(plan.port))
    shown = "127.0.0.1" if plan.host in ("0.0.0.0", "::", "") else plan.host
    out.append(Command("proxy", proxy, {}, f"http://{shown}:{plan.port}"))
    return out


# ------------------------------------------------------------------ command line


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``pushkv up`` to the ``pushkv`` command line."""
    from .proxy.cli import _Help, _Parser, _port

    d = Plan()
    parser_class = subparsers._parser_class
    subparsers._parser_class = _Parser  # one line and exit 2 on a bad flag
    try:
        p = subparsers.add_parser(
            "up", help="start a prefill and a decode vLLM server and pushkv proxy on this "
            "host; Ctrl-C stops all three",
            description="Start prefill (kv_producer) and decode (kv_consumer) vLLM servers "
            "with PushKVConnector and pushkv proxy in front of them, print where each "
            "listens, and stop them all on Ctrl-C or SIGTERM. Without --model it serves the "
            "CPU recipe's tiny random model (written to --tiny-model-dir if absent; no "
            "download) with vLLM's CPU build, one core per server.",
            formatter_class=_Help)
    finally:
        subparsers._parser_class = parser_class
    p.add_argument("--model", default=d.model, help="model to serve (a path or hub name, "
                   "with vLLM's own defaults); empty: the tiny recipe model")
    p.add_argument("--tiny-model-dir", default=d.tiny_model_dir, metavar="DIR",
                   help="directory of the tiny recipe model, written there if absent "
                   "(used when --model is empty)")
    p.add_argument("--host", default=d.host, help="address the proxy listens on (the vLLM "
                   "servers listen on 127.0.0.1)")
    p.add_argument("--port", type=_port, default=d.port, help="the proxy's port")
    p.add_argument("--prefill-port", type=_port, default=d.prefill_port,
                   help="the prefill server's port")
    p.add_argument("--decode-port", type=_port, default=d.decode_port,
                   help="the decode server's port")
    p.add_argument("--prefill-cpus", type=_cpus, default=d.prefill_cpus, metavar="CPUS",
                   help="cores of the prefill server's threads (VLLM_CPU_OMP_THREADS_BIND, "
                   "vLLM's CPU build; e.g. 0 or 0-3); empty: not set")
    p.add_argument("--decode-cpus", type=_cpus, default=d.decode_cpus, metavar="CPUS",
                   help="cores of the decode server's threads (as --prefill-cpus)")
    p.add_argument("--prefill-gpus", type=_cpus, default=d.prefill_gpus, metavar="GPUS",
                   help="GPUs of the prefill server (CUDA_VISIBLE_DEVICES, e.g. 0 or 0,1); "
                   "empty: not set")
    p.add_argument("--decode-gpus", type=_cpus, default=d.decode_gpus, metavar="GPUS",
                   help="GPUs of the decode server (as --prefill-gpus)")
    p.add_argument("--vllm-args", type=_vllm_args, default="", metavar="ARGS",
                   help="more vLLM flags for both servers, as one shell-quoted string "
                   "(e.g. '--tensor-parallel-size 2', or --vllm-args=--enforce-eager for one "
                   "flag); not --model, --host, --port or --kv-transfer-config, which "
                   "pushkv up sets")
    p.add_argument("--startup-timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="longest wait for the servers and the proxy to come up")
    p.add_argument("--log-dir", default="", metavar="DIR",
                   help="write each process's output to DIR/<name>.log; empty: to this "
                   "terminal, each line prefixed with its process's name")
    p.add_argument("--dry-run", action="store_true",
                   help="write the tiny model if absent, print the three command lines and "
                   "start nothing")
    p.set_defaults(func=_main)


def _cpus(text: str) -> str:
    if text and not _CPUS.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of device numbers like 0, "
                                         "0-3 or 0,2")
    return text


def _seconds(text: str) -> float:
    from .proxy.cli import _positive

    return _positive(text)


def _vllm_args(text: str) -> tuple[str, ...]:
    try:
        args = tuple(shlex.split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shell-quoted string ({exc})"
                                         ) from None
    for arg in args:
        if arg.split("=", 1)[0] in OWN_VLLM_FLAGS:
            raise argparse.ArgumentTypeError(f"{arg.split('=', 1)[0]} is set by pushkv up "
                                             "(use its own flags)")
    return args


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan the flags give; ValueError naming what is wrong."""
    ports = {"--port": args.port, "--prefill-port": args.prefill_port,
             "--decode-port": args.decode_port}
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise ValueError(f"{flag} and {seen[port]} are both {port}: each process needs "
                             "its own port")
        seen[port] = flag
    return Plan(model=args.model, tiny_model_dir=args.tiny_model_dir, host=args.host,
                port=args.port, prefill_port=args.prefill_port, decode_port=args.decode_port,
                prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
                prefill_gpus=args.prefill_gpus, decode_gpus=args.decode_gpus,
                vllm_args=tuple(args.vllm_args or ()), python=sys.executable)


def ensure_tiny_model(directory: str | os.PathLike[str]) -> bool:
    """Write the tiny recipe model to ``directory`` unless it holds one; True if written.
    A directory with the model but without a tokenizer gets the tokenizer."""
    from .testing import write_tiny_llama, write_word_tokenizer

    path = Path(directory)
    if not (path / "config.json").exists():
        write_tiny_llama(path)
        return True
    if not (path / "tokenizer.json").exists():
        write_word_tokenizer(path)
    return False


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port`` (or cannot be bound there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _refuse(message: str) -> NoReturn:
    print(f"pushkv up: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _main(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        _refuse(str(exc))
    if plan.tiny:
        try:
            if ensure_tiny_model(plan.tiny_model_dir):
                print(f"pushkv up: wrote the tiny recipe model to {plan.tiny_model_dir}",
                      flush=True)
        except ImportError as exc:
            _refuse(f"writing the tiny model needs torch, safetensors and tokenizers "
                    f"(install vLLM's CPU build): {exc}")
        except OSError as exc:
            _refuse(f"--tiny-model-dir {plan.tiny_model_dir}: {exc}")
    cmds = commands(plan)
    if args.dry_run:
        for c in cmds:
            print(f"# {c.name}: {c.url}\n{c.shell()}")
        return 0
    for c, host in zip(cmds, ("127.0.0.1", "127.0.0.1", plan.host), strict=True):
        port = int(c.url.rsplit(":", 1)[1])
        if port_taken(port, host):
            _refuse(f"port {port} ({c.name}) is in use on {host}: stop what listens there or "
                    f"choose another with --{'' if c.name == 'proxy' else c.name + '-'}port")
    return Up(cmds, log_dir=args.log_dir, startup_timeout_s=args.startup_timeout).run()


# ------------------------------------------------------------------ processes


class _Stop(Exception):
    """Ctrl-C or SIGTERM arrived."""


class Up:
    """Runs the commands of a plan until asked to stop or one of them ends."""

    def __init__(self, cmds: Sequence[Command], *, log_dir: str = "",
                 startup_timeout_s: float = 600.0, out: IO[str] | None = None) -> None:
        self.cmds = list(cmds)
        self.log_dir = Path(log_dir) if log_dir else None
        self.startup_timeout_s = startup_timeout_s
        self.out = out or sys.stdout
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._relays: list[threading.Thread] = []
        self._stop = threading.Event()
        self._why = ""

    def say(self, line: str) -> None:
        print(f"pushkv up: {line}", file=self.out, flush=True)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT,
                                                                   signal.SIGTERM)}
        try:
            return self._run()
        finally:
            self.stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._why = signal.Signals(signum).name
        self._stop.set()

    def _run(self) -> int:
        by_name = {c.name: c for c in self.cmds}
        servers = [c for c in self.cmds if c.name != "proxy"]
        for c in servers:
            self.start(c)
        if not self.wait_until(lambda: all(_answers(c.url + "/health") == 200
                                           for c in servers), "the vLLM servers"):
            return self._ended()
        self.start(by_name["proxy"])
        if not self.wait_until(lambda: _answers(by_name["proxy"].url + "/health") == 200,
                               "the proxy (both servers in its rotation)"):
            return self._ended()
        self.say("ready")
        for c in self.cmds:
            self.say(f"  {c.name:<8} {c.url}")
        self.say(f"send OpenAI requests to {by_name['proxy'].url}/v1/completions or "
                 "/v1/chat/completions; Ctrl-C stops all three")
        while not self._stop.wait(0.5):
            if (gone := self._exited()) is not None:
                self.say(f"{gone} exited with status {self.procs[gone].returncode}; "
                         "stopping the others")
                return 1
        return self._ended()

    def _ended(self) -> int:
        if self._stop.is_set():
            self.say(f"{self._why}: stopping proxy, decode, prefill")
            return 0
        return 1

    def start(self, c: Command) -> None:
        env = dict(os.environ) | dict(c.env)
        env["PYTHONUNBUFFERED"] = "1"
        self.say(f"starting {c.name} on {c.url}")
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with (self.log_dir / f"{c.name}.log").open("ab") as log:
                proc = subprocess.Popen(c.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, process_group=PROCESS_GROUP)
        else:
            proc = subprocess.Popen(c.argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    process_group=PROCESS_GROUP)
            relay = threading.Thread(target=self._relay, args=(c.name, proc), daemon=True)
            relay.start()
            self._relays.append(relay)
        self.procs[c.name] = proc

    def _relay(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            with contextlib.suppress(ValueError, OSError):
                print(f"[{name}] {raw.decode(errors='replace').rstrip()}", file=self.out,
                      flush=True)

    def _exited(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def wait_until(self, ready: Callable[[], bool], what: str) -> bool:
        """Poll ``ready`` until it holds; False (said why) when a process ended, the
        deadline passed, or a stop was asked for."""
        end = time.monotonic() + self.startup_timeout_s
        while not self._stop.is_set():
            if (gone := self._exited()) is not None:
                where = f" (see {self.log_dir / (gone + '.log')})" if self.log_dir else ""
                self.say(f"{gone} exited with status {self.procs[gone].returncode} while "
                         f"waiting for {what}{where}; stopping the others")
                return False
            if ready():
                return True
            if time.monotonic() > end:
                self.say(f"{what} did not come up within {self.startup_timeout_s:g} s; "
                         "stopping")
                return False
            self._stop.wait(0.5)
        return False

    def stop_all(self, grace_s: float = 30.0) -> None:
        """Stop the proxy, decode and prefill (each process group: SIGINT, then SIGKILL)."""
        for name in ("proxy", "decode", "prefill"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.say(f"{name} did not stop within {grace_s:g} s: killing it")
            # Whatever of its group is left (an engine core, a worker) goes now.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for relay in self._relays:
            relay.join(5)


def _answers(url: str) -> int:
    """The HTTP status ``url`` answers with; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return 0
