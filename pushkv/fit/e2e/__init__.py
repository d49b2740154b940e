"""The end-to-end harness: real vLLM deployments of every connector on one machine,
the ways requests reach them, and the verdict (``benchmarks/bench_e2e.sh``,
``benchmarks/e2e/run.py``; the sim-vs-real and hand-off benchmarks drive the same
deployments).

* :mod:`.modes` -- the deployments (plain, pushkv, nixl-push, nixl-pull) and the modes
  that reach them (client dispatch or a router; :mod:`.router_modes`: vllm-router);
* :mod:`.deployment` -- a deployment's servers, a mode's endpoint and router, the
  freezer that stops a deployment while another one's turn runs;
* :mod:`.client` -- the benchmark client: streamed requests, both legs sent itself;
* :mod:`.rounds` -- a phase's rounds, every mode on the same prompts, outputs checked
  against plain's; :mod:`.phases` -- the whole run, phase by phase;
* :mod:`.overheads` -- paired overheads over plain, their ratios and intervals, the
  run's verdict;
* :mod:`.bench_client` -- ``vllm bench serve``, one-off or kept up
  (``python -m pushkv.fit.e2e.bench_serve``);
* :mod:`.vllm_proxy` -- ``python -m pushkv.fit.e2e.vllm_proxy``: a minimal router for
  vLLM's own NIXL connectors, the baselines.

It imports the vLLM layer (:mod:`pushkv.vllm.testing` starts the servers) and not the
simulator; it lives in the fitting package, beside what measures real engines.
"""
