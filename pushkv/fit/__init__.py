"""The fitting pipeline: measure real engines on this machine, fit the simulator to them.

:mod:`pushkv.sim` is a model; this package is what ties it to a real deployment. It
sits above both the simulator and the vLLM integration and imports either; neither
imports it (the ``fit-above-sim-and-vllm`` contract in ``pyproject.toml``).

* :mod:`.measure` -- ``python -m pushkv.fit.measure``: a CPU profile of this machine,
  written as TOML: :mod:`.timings` times the real parts (a vLLM server's steps, a
  NIXL pair, the side channel), :mod:`.cpu_profile` fits the profile's keys to them;
* :mod:`.measure_connector` -- the profile's connector keys from a real pushkv pair's
  :mod:`pushkv.timeline` marks;
* :mod:`.segments` -- ``python -m pushkv.fit.segments``: a simulated run against a
  real one, segment by segment of their timelines;
* :mod:`.cores` -- :class:`~.cores.CoreProbe`, what a process meets on each core while
  a measurement runs;
* :mod:`.sim_vs_real` -- the simulator against real vLLM CPU engines, point by point:
  the library ``benchmarks/bench_sim_vs_real.py`` is a command line over;
* :mod:`.e2e` -- real vLLM deployments of every connector on this machine, the modes
  that reach them and the verdict: the harness of ``benchmarks/bench_e2e.sh``, whose
  deployments the sim-vs-real and hand-off benchmarks drive too;
* :mod:`.handoff` -- where a hand-off into decode's API server goes
  (``benchmarks/bench_handoff_waits.py``);
* :mod:`.gil_handoff` -- what a thread woken through a queue waits for the interpreter
  lock while its feeder runs Python (``benchmarks/bench_gil_handoff.py``).

The ``/proc`` readings (CPU time, run-queue waits, steal) are :mod:`pushkv.hostprobe`,
below this package, shared with the chaos harness of :mod:`pushkv.vllm.chaos`.
"""
