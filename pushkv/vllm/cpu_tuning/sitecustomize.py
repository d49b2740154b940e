"""CPU tuning of vLLM servers on a small machine, for tests and benchmarks.

This directory goes first on ``PYTHONPATH`` of a vLLM server
(:class:`pushkv.vllm.testing.ServerSpec` with ``spin_s`` set does it; so do the
benchmarks). Each fix is off unless its environment variable is set:

1. **Progress thread.** NIXL's Python wrapper creates every agent with
   ``pthrDelay = 0``: each agent's UCX progress thread busy-spins a core, even
   idle. With ``PUSHKV_BENCH_NIXL_DELAY_US`` set, agents sleep that long
   between polls -- the value pushkv's ``progress_delay_us`` gets in the same run.
2. **Placement.** vLLM's NIXL worker pins itself to the last core of each NUMA
   node (on 2 cores: both servers on core 1). With ``PUSHKV_BENCH_KEEP_CORE``
   set, that call keeps the worker on the cores it was bound to
   (``VLLM_CPU_OMP_THREADS_BIND``), where pushkv's transport runs too.
3. **Spinning.** vLLM's worker and engine processes busy-loop (``sched_yield``)
   on their shared-memory queue for ``busy_loop_s`` (1 s) after each message
   before they sleep on a socket, so on this 2-core machine every server that
   served a request in the last second takes CPU from the one serving now. An
   engine that waits for KV (a decode request waiting for its transfer, a
   prefill holding blocks until they are pushed) steps all the time, so its
   processes spin for as long as it waits: two such servers with three workers
   on two cores starved a rank's side channel for minutes (the heterogeneous-TP
   test, see ``docs/vllm.md``). With ``PUSHKV_BENCH_SPIN_S`` set, that period is
   this many seconds (``pushkv.vllm.testing.SPIN_S``: 2 ms), and a reader that
   sleeps rechecks its queue every 5 ms (vLLM's default is longer, and a lost
   wake-up then stalls a request for that long) -- in every server of a run,
   plain ones included (bench_e2e.sh ``--spin-s``).
4. **Timeline.** With ``PUSHKV_BENCH_TIMELINE_DIR`` set, the connector's
   scheduler marks ``prefill_seen``, ``decode_seen`` (and the API server's
   ``*_arrived``, from the request's ``arrival_time``), ``prefill_finished``,
   ``ready_scheduled`` and ``decode_scheduled`` (:mod:`pushkv.timeline`) under
   the request's ``X-Request-Id`` (32 hex digits, as the benchmark sends them).
   Every process of the server records there from its start, so the API
   server's garbage-collector pauses are written down too
   (:func:`pushkv.timeline.record_gc`). Inside vLLM it marks each leg's intake
   (:data:`pushkv.timeline.INTAKE`): the API server handing it to its engine core
   client (``AsyncMPClient.add_request_async``), the engine core's input thread
   queueing it for the loop (``EngineCoreProc.preprocess_add_request``), the loop
   taking it between steps (``_handle_client_request``). With ``PUSHKV_BENCH_SPANS``
   set too, it records each step of the engine loop (``EngineCore.step``) and each
   model run of its worker (``Worker.execute_model``) as spans
   (:func:`pushkv.timeline.span`): a line a step in each of two processes, off by
   default (``bench_sim_vs_real.py --engine-spans``).
5. **Switch interval.** With ``PUSHKV_BENCH_SWITCH_S`` set, every server process's
   interpreter asks a running thread to hand over the GIL after that many seconds
   (``sys.setswitchinterval``; CPython's default is 5 ms): how long a transport thread
   waits for the interpreter while the engine's thread runs Python. A value that is
   not a positive number of seconds is reported on stderr and leaves CPython's.
"""

import importlib.abc
import importlib.machinery
import os
import re
import sys

_DELAY = int(os.environ.get("PUSHKV_BENCH_NIXL_DELAY_US", "0") or 0)
_KEEP = os.environ.get("PUSHKV_BENCH_KEEP_CORE", "")
_TIMELINE = os.environ.get("PUSHKV_BENCH_TIMELINE_DIR", "")
_SPIN = os.environ.get("PUSHKV_BENCH_SPIN_S", "")
_SWITCH = os.environ.get("PUSHKV_BENCH_SWITCH_S", "")
_SPANS = os.environ.get("PUSHKV_BENCH_SPANS", "")

if _SWITCH:
    try:
        _seconds = float(_SWITCH)
        if not 0 < _seconds < float("inf"):
            raise ValueError(_SWITCH)
        sys.setswitchinterval(_seconds)
    except ValueError:
        print(f"pushkv cpu_tuning: PUSHKV_BENCH_SWITCH_S={_SWITCH!r} is not a positive "
              "number of seconds; the switch interval stays CPython's", file=sys.stderr)

if _DELAY > 0:
    try:
        import nixl._api as _api

        _bind = _api.nixlBind
        _original = _bind.nixlAgent

        def _throttled(name, config):  # type: ignore[no-untyped-def]
            config.pthrDelay = _DELAY
            return _original(name, config)

        _bind.nixlAgent = _throttled
    except Exception:  # nixl missing or changed: run unthrottled
        pass

if _KEEP and hasattr(os, "sched_setaffinity"):
    _setaffinity = os.sched_setaffinity

    def _keep_core(pid, cpus):  # type: ignore[no-untyped-def]
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.endswith("kv_connector.v1.nixl.base_worker"):
            cpus = {int(c) for c in _KEEP.split(",")}
        return _setaffinity(pid, cpus)

    os.sched_setaffinity = _keep_core

_RID = re.compile(r"[0-9a-f]{32}")


def _rid(request_id):  # type: ignore[no-untyped-def]
    """The benchmark's request id (X-Request-Id) inside vLLM's, or None."""
    m = _RID.search(request_id)
    return m.group(0) if m else None


def _side(kv):  # type: ignore[no-untyped-def]
    """The leg a server's process serves, by its KV role (its KVTransferConfig)."""
    return "decode" if kv is not None and kv.is_kv_consumer else "prefill"


def _instrument(module):  # type: ignore[no-untyped-def]
    from pushkv import timeline

    cls = module.NixlBaseConnector
    seen, loaded = set(), set()

    def rid(request):  # type: ignore[no-untyped-def]
        return _rid(request.request_id)

    get_matched = cls.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # type: ignore[no-untyped-def]
        r = rid(request)
        if r and request.request_id not in seen:
            seen.add(request.request_id)
            side = _side(self._kv_transfer_config)
            timeline.mark(r, f"{side}_arrived", timeline.from_wall(request.arrival_time))
            timeline.mark(r, f"{side}_seen")
        return get_matched(self, request, num_computed_tokens)

    after_alloc = cls.update_state_after_alloc

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        r = rid(request)
        if r and request.request_id in loaded:
            loaded.discard(request.request_id)
            timeline.mark(r, "decode_scheduled")
        return after_alloc(self, request, blocks, num_external_tokens)

    def on_finished(self, request):  # type: ignore[no-untyped-def]
        r = rid(request)
        seen.discard(request.request_id)
        if r and _side(self._kv_transfer_config) == "prefill":
            timeline.mark(r, "prefill_finished")

    finished = cls.request_finished

    def request_finished(self, request, block_ids):  # type: ignore[no-untyped-def]
        on_finished(self, request)
        return finished(self, request, block_ids)

    finished_all = cls.request_finished_all_groups  # what the scheduler calls (HMA)

    def request_finished_all_groups(self, request, block_ids):  # type: ignore[no-untyped-def]
        on_finished(self, request)
        return finished_all(self, request, block_ids)

    update = cls.update_connector_output

    def update_connector_output(self, connector_output):  # type: ignore[no-untyped-def]
        for req_id in connector_output.finished_recving or ():
            r = _rid(req_id)
            if r:
                loaded.add(req_id)
                timeline.mark(r, "ready_scheduled")
        return update(self, connector_output)

    cls.get_num_new_matched_tokens = get_num_new_matched_tokens
    cls.update_state_after_alloc = update_state_after_alloc
    cls.request_finished = request_finished
    cls.request_finished_all_groups = request_finished_all_groups
    cls.update_connector_output = update_connector_output
    timeline.configure(_TIMELINE, f"vllm-{os.getpid()}")


def _short_spin(module):  # type: ignore[no-untyped-def]
    cls = module.SpinCondition
    init = cls.__init__
    spin = float(_SPIN)

    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):  # type: ignore[no-untyped-def]
        init(self, is_reader, context, notify_address, min(busy_loop_s, spin))

    cls.__init__ = __init__
    module.SHM_READER_RECHECK_INTERVAL_MS = min(module.SHM_READER_RECHECK_INTERVAL_MS, 5)


def _engine_core(module):  # type: ignore[no-untyped-def]
    import time

    from pushkv import timeline

    proc = module.EngineCoreProc
    preprocess = proc.preprocess_add_request

    def preprocess_add_request(self, request):  # type: ignore[no-untyped-def]
        out = preprocess(self, request)  # on the input thread, before the loop's queue
        r = _rid(request.request_id)
        if r:
            timeline.mark(r, f"{_side(self.vllm_config.kv_transfer_config)}_queued")
        return out

    handle = proc._handle_client_request

    def _handle_client_request(self, request_type, request):  # type: ignore[no-untyped-def]
        if request_type == module.EngineCoreRequestType.ADD:  # the loop, between steps
            r = _rid(request[0].request_id)
            if r:
                timeline.mark(r, f"{_side(self.vllm_config.kv_transfer_config)}_taken")
        return handle(self, request_type, request)

    proc.preprocess_add_request = preprocess_add_request
    proc._handle_client_request = _handle_client_request
    if not _SPANS:
        return
    for name in ("step", "step_with_batch_queue"):  # the loop's step_fn is one of them
        original = getattr(module.EngineCore, name)

        def step(self, _original=original):  # type: ignore[no-untyped-def]
            t0 = time.monotonic()
            try:
                return _original(self)
            finally:
                timeline.span("step", t0, time.monotonic())

        setattr(module.EngineCore, name, step)


def _worker(module):  # type: ignore[no-untyped-def]
    import time

    from pushkv import timeline

    execute = module.Worker.execute_model

    def execute_model(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return execute(self, *args, **kwargs)
        finally:
            timeline.span("forward", t0, time.monotonic())

    module.Worker.execute_model = execute_model


def _core_client(module):  # type: ignore[no-untyped-def]
    from pushkv import timeline

    cls = module.AsyncMPClient
    add = cls.add_request_async

    async def add_request_async(self, request):  # type: ignore[no-untyped-def]
        r = _rid(request.request_id)
        if r:
            timeline.mark(r, f"{_side(self.vllm_config.kv_transfer_config)}_sent")
        return await add(self, request)

    cls.add_request_async = add_request_async


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patch a vLLM module right after it is imported (see the module's docstring)."""

    def __init__(self, patches):  # type: ignore[no-untyped-def]
        self.patches = patches

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_instrument(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            try:
                patch(module)
            except Exception as exc:  # the benchmark still runs, without this patch
                print(f"pushkv bench: cannot patch {fullname}: {exc!r}", file=sys.stderr)

        loader.exec_module = exec_and_instrument  # type: ignore[method-assign]
        return spec


if _TIMELINE:
    try:  # every process of the server, its API server included
        from pushkv import timeline as _timeline

        _timeline.configure(_TIMELINE, f"vllm-{os.getpid()}")
    except Exception as _exc:  # the server still runs, without its own records
        print(f"pushkv bench: no timeline: {_exc!r}", file=sys.stderr)

_PATCHES = {}
if _TIMELINE:
    _PATCHES["vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"] = _instrument
    _PATCHES["vllm.v1.engine.core"] = _engine_core
    _PATCHES["vllm.v1.engine.core_client"] = _core_client
    if _SPANS:
        _PATCHES["vllm.v1.worker.gpu_worker"] = _worker
if _SPIN:
    _PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _short_spin
if _PATCHES:
    sys.meta_path.insert(0, _AfterImport(_PATCHES))
