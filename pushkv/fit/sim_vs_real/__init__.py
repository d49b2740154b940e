"""The simulator against real vLLM CPU engines on this machine, point by point: the library.

``benchmarks/bench_sim_vs_real.py`` is the command line: it runs the real half (it
drives :mod:`pushkv.fit.e2e`'s deployments and ``vllm bench serve``) and then
:func:`.sim_half.sim_half`, which is all ``--sim-only`` runs on a recorded real half.
The modules, from the bottom:

* :mod:`.runs` -- a run's directory: its points, file names, and what the real half
  records per point (``cpu_probe.json``, the probe's wake-ups);
* :mod:`.deployment` -- what a running deployment's parts spend (CPU, run-queue
  waits, threads, garbage-collector pauses), read through :mod:`pushkv.hostprobe`;
* :mod:`.keys` -- a point's profile keys from its gauges or the real half's marks;
* :mod:`.simulate` -- the simulated half, one way (:func:`~.simulate.run_sim`);
* :mod:`.report` -- the sim/real ratio tables and how far one run can tell;
* :mod:`.tables` -- segment by segment, and grouped by how each request was served;
* :mod:`.sim_half` -- every way simulated and compared, the summary;
* :mod:`.cross` -- cross-validation (``--cross-validate``): keys from the training
  points' gauges alone, the held-out points (rates above, lengths beyond) predicted
  and judged apart, the knee of a rate sweep, real and simulated.

**Real half**: pushkv push (``PushKVConnector`` behind ``pushkv proxy``, mode
``push``) and vLLM pull (vLLM's ``NixlConnector`` behind the pull relay of
``pushkv.fit.e2e.vllm_proxy``, mode ``pull``), each a prefill server on core 0
and a decode server on core 1 (the deployments of :mod:`pushkv.fit.e2e`:
tiny model, prefix caching off, every NIXL progress thread sleeping
``--delay-us`` between polls, every transport thread on its server's core).
``vllm bench serve`` (random dataset, ``--ignore-eos``) runs every (input
length, rate) point against each router; the deployments alternate each
iteration (push, pull, push, ...), so slow drift of the shared machine's load
reaches both modes. During each point a probe process on each core
(:class:`pushkv.fit.cores.CoreProbe`) records its wake-up delay and share (each
wake-up, with when it was due, in ``OUT/real/wakes/<point>.json``), and the
two servers' vLLM metrics are read before and after (``OUT/real/cpu_probe.json``).
Around each point, *gauges* (``--gauge N``): N lone requests through the same router
at the point's lengths and rate just before and just after it (``gauge`` in the command line,
:func:`.keys.gauge_rate`), the core probe's wake-ups during each kept too; and once per
deployment, where a lone request's CPU goes (``cores_busy`` in the command line, from ``/proc``).
For the point and for its gauge just after it, how long each part of the deployment
waited on a run queue, a request (:func:`.deployment.runq_waits`, ``runq_wait_ms`` and
``gauge_runq_wait_ms`` in ``cpu_probe.json``): where the cores were short. And
while the point loaded the deployment (:func:`.deployment.load_span`: its requests' first mark to
their last), each part's threads pinned to one core and floating apart: the cores
they kept busy, how many waited on a run queue, and how long a wake-up waited
(:class:`.deployment.SchedSamples`, every 0.25 s; ``threads`` in ``cpu_probe.json``). Over each
point and each gauge, the share of each core its host took (a VM's steal time,
:func:`pushkv.hostprobe.steal`; ``steal`` in ``cpu_probe.json`` and in each gauge's record).
While the point loaded the deployment, each part's garbage-collector pauses and the
client's (:func:`.deployment.gc_pauses`; ``gc`` in ``cpu_probe.json``): every process that records
a timeline writes them down (:func:`pushkv.timeline.record_gc`).
Result files: ``OUT/real/{mode}_qps{q}_in{i}_out{o}_iter{n}.json``. Points already
in ``OUT/real`` are not run again (an interrupted run resumes; so does one whose
deployment failed to start, run again with the same ``--out`` and ``--profile``).
Eight iterations by default: on this machine a few requests of a point stall for
tens to hundreds of milliseconds, so one iteration's real mean TTFT can be several
times the next one's at the same point. One ``vllm bench serve`` process
(:class:`pushkv.fit.e2e.bench_client.BenchClient`) runs every point and gauge, so a
point's window is its load, not the client's import (10-12 s each, which took most of
the real half's time before), and eight iterations take about as long as four did.

**Simulated half**: ``pushkv.sim`` with the measured profile
(``pushkv/sim/profiles/cpu-tiny.toml``) at the same points -- same modes, number
of prompts, rates, lengths, output length and iterations, and the very send times
``vllm bench serve`` used (``--arrivals vllm``, the default: its seed, its
generator) -- four ways: a core per
engine (``OUT/sim-own-cores``), on the cores the probe met (``cpu_share``,
``wake_s``; ``OUT/sim``), each point with the profile its gauges measured, on the
machine's shared cores (``OUT/sim-gauge``, the headline when the run has gauges:
:func:`.keys.gauge_keys`), and, as a diagnosis, with the engines' steps as the real
servers' metrics gave them (``OUT/sim-server-steps``). ``--frontend-cores N``
replaces the profile's ``host.frontend_cores`` (the API servers', router's and
client's times as one queue, :mod:`pushkv.sim.host.frontend`; a profile ``--measure``
writes has it from the machine's cores). The ways on shared cores place the processes as the
deployment does unless told otherwise (:data:`.runs.PINNED_ENGINES`: each engine's loop
on its side's core, ``host.pinned``; :data:`.runs.API_LOOPS`: each API server a loop of
its own where the run measured ``host.token_api_s``), and a gauged point's steps are
fitted on that host.

**Segment by segment**: the real half's router, client and servers record
:mod:`pushkv.timeline` marks (``OUT/real/timeline/<mode>/``, ``<deployment>/``;
each point's interval in ``time.monotonic()`` is kept in ``cpu_probe.json``), the
simulated half records the same marks per point (``OUT/sim-timeline/<way>/<point>/``,
:mod:`pushkv.sim.marks`); for every point both recorded, a table of each segment's
real and simulated median / p90 (:mod:`pushkv.fit.segments`). Then, per mode and
rate, the points' requests grouped by how many others overlapped them on the way to
their first token, real against the gauge way (:func:`.tables.overlap_tables`): where
the two agree on requests served alone, a gap that grows with the overlap is the
load's cost the model leaves out; and by each request's place in its point
(:func:`.tables.place_tables`): a gap at the first places alone is something at the points'
start, not the load; and by what else a request met on its way to its first token
(:func:`.tables.neighbour_tables`: alone, one other decoding, one before its first token, one
that came later, more), each group's segments: which hand-off a neighbour lengthens.
And the lone requests of the gauges against those of the points, with the probe's
wake-ups in each (:func:`.tables.lone_gap`): what a point's lone requests pay that the keys,
measured on the gauges', do not hold.

The gauges run with the core probe too, so a second gauge way (``OUT/sim-gauge-speed``)
can simulate each point with its cores as fast against its gauges' as the probe saw
(each side's ``cpu_speed``, :func:`.keys.gauge_speed`), printed beside the headline. The
gauge way's ``host.wake_beside_s`` is the run's: the probe's wake-ups against the
points' timelines (:func:`.keys.wake_beside_of`); the gauge way is simulated again
without it (``OUT/sim-gauge-no-wake``, ``gauge_no_wake`` in the summary) and printed
beside the headline, so every run shows the mechanism's part. A point's keys from its
two gauges are mostly sampling noise (a median of some 20 lone requests of a broad
segment), so each is shrunk toward the mean over the run of its gauges' group (mode,
length, rate) by how far the group's gauges one at a time tell points apart
(:func:`.keys.gauge_noise`, :func:`pushkv.fit.measure_connector.shrink_keys`; the table
is printed, ``noise`` in the summary's ``gauge_keys``); the gauge way is simulated again
with the keys as measured (``OUT/sim-gauge-unshrunk``, ``gauge_unshrunk`` in the
summary). A gauge's step times are lone requests' wall times, which hold the work each
request brought beside its steps (the loop holding it, its tokens' way out); on the
shared cores the model adds that work again, so each point's steps are first made to
give those wall times to a lone request simulated there
(:func:`pushkv.fit.measure_connector.lone_steps`); the gauge way is simulated again with
the steps as timed (``OUT/sim-gauge-wall-steps``, ``gauge_wall_steps``).

**How far one run can tell** (:func:`.report.precision`): per point and statistic, the
iterations' sim/real ratios, their mean and its 95% interval (Student's t), with a
verdict: ``in`` or ``out`` when the whole interval lies in or outside 0.75-1.33
(:data:`.report.BAND`; out: a miss the iterations agree on, the model's), ``unsure`` when it
straddles a side (the iterations disagree more than the band is wide), and how many
iterations an interval as narrow as the band would need at the run's spread.

Prints a table of sim/real ratios per way (mean and median TTFT and TPOT, per
point and mode, iterations averaged), the segment tables, the precision table, and,
last, one JSON object for the headline way (``"way"``: gauge, else probe):
``ttft_ratio_min``, ``ttft_ratio_max``, ``tpot_ratio_min``, ``tpot_ratio_max``,
``points`` (the per-point ratios, and the other ways' ranges under ``own_cores``,
``server_steps`` and ``gauge_speed``), ``precision`` (the intervals, the verdicts
counted, ``iterations_needed_max``), ``segments``
(per way and point, each segment's real and simulated median in ms), ``by_overlap``
``by_place`` and ``by_neighbour`` (the groups' rows), ``lone_gap``. Figures (``--figures DIR``, or
``pushkv plot --results-dir OUT/real --overlay OUT/sim --labels real sim --metric ttft``).
"""
