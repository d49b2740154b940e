"""Poison requests among good ones: does one bad request cost anyone else anything?

1P2D on this machine: one prefill and two decode vLLM CPU servers with
PushKVConnector (the recipe's tiny model, served with its word tokenizer and chat
template) behind one ``pushkv proxy`` with its default health settings. Clients
send ``--requests`` requests (default 500), ``--clients`` at a time, of which
``--poison`` (default 5%) are poison, spread at random among the good ones and
cycling through these kinds:

* ``token_id_past_vocab``: a token-id prompt with an id at or past the model's
  vocabulary (without the proxy's check such an id crashes the engine cores of a
  server started without a tokenizer). Expected: 400 from the proxy; no engine
  sees it.
* ``grammar_fails_in_engine``: a completion with a JSON-schema structured output.
  It passes the proxy and the engine's checks, and fails inside the engine while
  generating: the tiny model's tokenizer has no token that can start JSON, the
  grammar rejects the sampled token and vLLM terminates the request ("grammar
  rejected tokens"), answering 500. Both legs carry it, and the proxy passes on
  the first failure: 502 naming the prefill instance when the prefill leg failed
  first, the decode instance's 500 (named too) when the decode leg did. Expected:
  one of the two, the request not sent to another instance, and every instance
  still in rotation.
* ``text_past_context``: a text prompt that tokenizes past the model's length
  (the proxy knows exact lengths of token-id prompts only). Expected: the
  engine's 400, passed on.
* ``chat_unknown_role``: a chat message whose role the chat template refuses.
  Expected: the engine's 400, passed on.

Good requests are token-id completions (streamed and not, 8-120 prompt tokens,
fresh prompts) checked token by token against a plain server's greedy output,
computed before the fleet starts. Meanwhile the proxy's ``/metrics`` is read
every half second: any instance seen out of rotation is lost, as is one whose
process ended. Takes 3-5 minutes with the defaults (servers' start included)::

    PYTHONPATH=. python benchmarks/bench_poison.py [--requests 500] [--out DIR]

Prints a table (outcome by kind), then one JSON line: ``good_requests_failed``
(wrong, errors, hung; target 0), ``instances_lost`` (target 0),
``poison_answered_4xx``, ``poison_answered_5xx``, ``poison_unclear`` (no clear
error; target 0), ``retries`` (sends of a request to a second instance; target 0),
per-kind status counts, and the decode servers' prompt tokens received over the
connector and computed locally (vLLM's ``prompt_tokens_by_source``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pushkv.vllm.chaos import STARTUP_S, Fleet, prompt, references, request  # noqa: E402
from pushkv.vllm.proxy.pool import HealthSettings  # noqa: E402
from pushkv.vllm.testing import (  # noqa: E402
    TINY_LLAMA,
    Server,
    get_text,
    metric,
    post_json,
    write_tiny_llama,
)

#: The poison kinds, in the order they are cycled through.
KINDS = ("token_id_past_vocab", "grammar_fails_in_engine", "text_past_context",
         "chat_unknown_role")
#: Statuses each kind is expected to get (anything else is reported).
EXPECTED = {"token_id_past_vocab": {400}, "grammar_fails_in_engine": {500, 502},
            "text_past_context": {400}, "chat_unknown_role": {400}}
#: What the proxy says of a request an engine failed on (it is not sent elsewhere).
NOT_RETRIED = "it was not sent to another instance"
LENGTH = 256  #: the servers' --max-model-len
VOCAB = TINY_LLAMA["vocab_size"]
NAMES = ("prefill-0", "decode-0", "decode-1")
CPUS = (0, 1, 0)


@dataclass
class Job:
    poison: str  #: "" for a good request, else its kind
    index: int
    tokens: list[int] = field(default_factory=list)
    expect: list[int] = field(default_factory=list)
    stream: bool = False


@dataclass
class Result:
    job: Job
    kind: str  #: correct, wrong, clear_error, hung, unclear
    status: int
    detail: str = ""


def poison_body(kind: str, model: str, rng: random.Random, max_tokens: int
                ) -> tuple[str, dict[str, Any]]:
    """(path, body) of one poison request of ``kind``."""
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if kind == "token_id_past_vocab":
        ids = prompt(rng.randrange(4, 40), rng.randrange(1 << 30))
        ids[rng.randrange(len(ids))] = rng.choice((VOCAB, VOCAB + rng.randrange(1, 10**6)))
        return "/v1/completions", {**base, "prompt": ids}
    if kind == "grammar_fails_in_engine":
        return "/v1/completions", {**base, "prompt": prompt(rng.randrange(4, 40),
                                                            rng.randrange(1 << 30)),
                                   "structured_outputs": {"json": {"type": "object"}}}
    if kind == "text_past_context":
        words = " ".join(f"w{t}" for t in prompt(LENGTH + rng.randrange(1, 60),
                                                  rng.randrange(1 << 30)))
        return "/v1/completions", {**base, "prompt": words}
    if kind == "chat_unknown_role":
        return "/v1/chat/completions", {**base, "messages": [
            {"role": "narrator", "content": "w5 w6 w7"}]}
    raise ValueError(f"unknown poison kind {kind!r}")


def send_poison(url: str, job: Job, model: str, max_tokens: int, timeout_s: float) -> Result:
    path, body = poison_body(job.poison, model, random.Random(job.index), max_tokens)
    try:
        status, answer = post_json(url + path, body, timeout=timeout_s)
    except OSError as exc:
        return Result(job, "unclear", 0, repr(exc)[:300])
    err = answer.get("error") if isinstance(answer, dict) else None
    clear = status != 200 and isinstance(err, dict) and bool(err.get("message"))
    if clear and status >= 500:  # an engine failed it: the answer must say it was not resent
        clear = NOT_RETRIED in str(err["message"])  # type: ignore[index]
    return Result(job, "clear_error" if clear else "unclear", status,
                  json.dumps(answer)[:300])


def send_good(url: str, job: Job, model: str, timeout_s: float) -> Result:
    out = request(url, model, job.tokens, job.expect, stream=job.stream, timeout_s=timeout_s)
    return Result(job, out.kind, out.status, out.detail)


class Watch(threading.Thread):
    """Reads the proxy's view of every instance every half second; remembers any seen
    out of rotation."""

    def __init__(self, fleet: Fleet, url: str) -> None:
        super().__init__(daemon=True)
        self.fleet, self.url = fleet, url
        self.out: set[str] = set()
        self.reads = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.read()

    def read(self) -> None:
        try:
            text = get_text(self.url + "/metrics", timeout=10)
        except OSError:
            return
        self.reads += 1
        for name in NAMES:
            url = self.fleet.instances[name].url
            if metric(text, "pushkv_proxy_instance_up", url=url) != 1:
                self.out.add(name)


def decode_tokens(fleet: Fleet, dead: set[str]) -> dict[str, float]:
    """The decode servers' prompt tokens so far, received over the connector and
    computed locally (vLLM's ``prompt_tokens_by_source``)."""
    return {src: sum(fleet.counter(n, "vllm:prompt_tokens_by_source_total", source=src)
                     for n in NAMES[1:] if n not in dead)
            for src in ("external_kv_transfer", "local_compute")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-poison-"))
    model = str(write_tiny_llama(out / "tiny-llama"))
    rng = random.Random(args.seed)
    n_poison = round(args.requests * args.poison)
    n_good = args.requests - n_poison
    lengths = [rng.randrange(8, 121) for _ in range(n_good)]
    prompts = [prompt(n, rng.randrange(1 << 30)) for n in lengths]

    fleet = Fleet(model, out / "logs")
    for name, cpu in zip(NAMES, CPUS, strict=True):
        inst = fleet.add(name, name.split("-")[0], cpu)
        inst.spec = replace(inst.spec, tokenizer=True)  # text and chat are served too
        inst.server = Server(inst.spec, fleet.logs / f"{name}.log")
    plain_spec = replace(fleet.plain(cpu=0).spec, tokenizer=True)
    plain = Server(plain_spec, fleet.logs / "plain.log")
    try:
        print(f"references: {n_good} greedy outputs of a plain server", flush=True)
        plain.start()
        plain.wait_healthy(STARTUP_S)
        expects = references(plain.url, model, prompts, args.max_tokens)
        plain.stop()  # before the fleet starts: three servers at most
        print("starting 1 prefill and 2 decode servers", flush=True)
        fleet.start(*NAMES)
        h = HealthSettings()
        url = fleet.proxy(["prefill-0"], ["decode-0", "decode-1"],
                          "--health-timeout", str(h.timeout_s), "--unhealthy-after",
                          str(h.unhealthy_after), "--backoff-max", str(h.backoff_max_s),
                          "--health-interval", str(h.interval_s),
                          timeout_s=args.timeout)
        jobs = [Job("", i, p, e, stream=bool(i % 2))
                for i, (p, e) in enumerate(zip(prompts, expects, strict=True))]
        jobs += [Job(KINDS[i % len(KINDS)], n_good + i) for i in range(n_poison)]
        rng.shuffle(jobs)
        retries0 = metric(get_text(url + "/metrics"), "pushkv_proxy_retries_total")
        tokens0 = decode_tokens(fleet, set())  # after the proxy's discovery requests
        watch = Watch(fleet, url)
        watch.read()
        watch.start()
        started = time.monotonic()

        def one(job: Job) -> Result:
            if job.poison:
                return send_poison(url, job, model, args.max_tokens, args.timeout)
            return send_good(url, job, model, args.timeout)

        print(f"sending {len(jobs)} requests ({n_poison} poison), {args.clients} at a time",
              flush=True)
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(one, jobs))
        elapsed = time.monotonic() - started
        watch.done.set()
        watch.join(15)
        watch.read()
        retries = metric(get_text(url + "/metrics"), "pushkv_proxy_retries_total") - retries0
        dead = {n for n in NAMES if not fleet.instances[n].server.alive()}
        # Proof that the KV moved: decode's prompt tokens by where they came from.
        tokens = {k: v - tokens0[k] for k, v in decode_tokens(fleet, dead).items()}
    finally:
        plain.stop()
        fleet.stop()

    good = [r for r in results if not r.job.poison]
    bad = [r for r in results if r.job.poison]
    failed = [r for r in good if r.kind != "correct"]
    by_kind: dict[str, Counter[int]] = {k: Counter() for k in KINDS}
    for r in bad:
        by_kind[r.job.poison][r.status] += 1
    unexpected = [r for r in bad
                  if r.status not in EXPECTED[r.job.poison] or r.kind != "clear_error"]
    lost = sorted(dead | watch.out)
    print(f"\n{'requests':<28}{'sent':>6}  outcome")
    print(f"{'good':<28}{len(good):>6}  " + ", ".join(
        f"{k} {v}" for k, v in sorted(Counter(r.kind for r in good).items())))
    for kind in KINDS:
        print(f"{kind:<28}{sum(by_kind[kind].values()):>6}  " + ", ".join(
            f"HTTP {s}: {c}" for s, c in sorted(by_kind[kind].items()))
            + f"  (expected {' or '.join(map(str, sorted(EXPECTED[kind])))})")
    print(f"instances lost: {lost or 'none'} (out of rotation at some read: "
          f"{sorted(watch.out) or 'none'}, dead: {sorted(dead) or 'none'}; "
          f"{watch.reads} reads of the proxy's view)")
    for r in (failed + unexpected)[:10]:
        print(f"  {r.job.poison or 'good'} #{r.job.index}: {r.kind} HTTP {r.status} "
              f"{r.detail[:200]}")
    print(f"decode prompt tokens: {tokens['external_kv_transfer']:.0f} transferred, "
          f"{tokens['local_compute']:.0f} computed")
    print(f"logs: {out / 'logs'}")
    return {
        "requests": len(results), "good_requests": len(good), "poison_requests": len(bad),
        "good_requests_failed": len(failed),
        "good_requests_by_outcome": dict(Counter(r.kind for r in good)),
        "instances_lost": len(lost),
        "poison_answered_4xx": sum(400 <= r.status < 500 for r in bad),
        "poison_answered_5xx": sum(500 <= r.status < 600 for r in bad),
        "poison_unclear": sum(r.kind != "clear_error" for r in bad),
        "poison_unexpected_status": len(unexpected),
        "poison_by_kind": {k: {str(s): c for s, c in sorted(v.items())}
                           for k, v in by_kind.items()},
        "retries": int(retries),
        "decode_prompt_tokens_transferred": int(tokens["external_kv_transfer"]),
        "decode_prompt_tokens_computed": int(tokens["local_compute"]),
        "elapsed_s": round(elapsed, 1),
    }


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is below {low}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=_at_least(len(KINDS) * 5), default=500,
                   help="requests sent, poison included")
    p.add_argument("--poison", type=_fraction, default=0.05,
                   help="share of the requests that are poison")
    p.add_argument("--clients", type=_at_least(1), default=4, help="requests in flight")
    p.add_argument("--max-tokens", type=_at_least(1), default=8,
                   help="output tokens of each request")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="a client's patience and the proxy's request bound (seconds)")
    p.add_argument("--seed", type=int, default=0, help="prompts and the order of requests")
    p.add_argument("--out", default="", help="directory for the model and the logs "
                   "(default: a new temporary directory)")
    args = p.parse_args(argv)
    summary = run(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
