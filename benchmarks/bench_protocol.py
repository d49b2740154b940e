"""Complete request lifecycles per second through the in-memory transport.

A lifecycle: the consumer registers, prefill finishes, the producer meets the
registration (rendezvous), plans and issues the write, the bytes are copied,
the notification is delivered and counted, the consumer declares READY and
the producer releases its source blocks. Every control message is really
encoded and decoded. Requests are small (32 tokens, 2 layers), so the figure
is the protocol's own cost, on one core, for TP 1->1 and TP 8->8 (where one
lifecycle is 8 producer and 8 consumer endpoints' work). Last line: JSON.
"""

from __future__ import annotations

import json
import time

from pushkv.protocol import uniform_ranks
from pushkv.transports.inmemory import pair

TOKENS, BATCH = 32, 200


def lifecycles_per_s(tp: int, total: int) -> float:
    kw = {"tp": tp, "num_kv_heads": tp, "num_blocks": 4 * BATCH, "block_size": 16,
          "head_dim": 64}
    net = pair(uniform_ranks("P", **kw), uniform_ranks("D", **kw), latency=0.0,
               write_latency=0.0)
    producers, consumers = list(net.producers.values()), list(net.consumers.values())
    done = 0
    t0 = time.process_time()
    while done < total:
        for i in range(BATCH):
            tid = f"r{done + i}"
            blocks = [2 * i, 2 * i + 1]
            for c in consumers:
                c.apply(c.endpoint.register(tid, "P", blocks, TOKENS, net.now))
            for p in producers:
                p.apply(p.endpoint.prefill_finished(tid, blocks, TOKENS, net.now))
        net.run()
        done += BATCH
    wall = time.process_time() - t0
    ready = sum(len(c.outcomes) for c in consumers)
    assert ready == total * len(consumers), "not every lifecycle completed"
    assert all(not p.endpoint.held_blocks() for p in producers)
    assert all(not c.endpoint.lent_blocks() for c in consumers)
    assert not net.violations
    return total / wall


def main() -> None:
    tp1 = lifecycles_per_s(1, 20_000)
    tp8 = lifecycles_per_s(8, 2_000)
    print(f"TP 1->1: {tp1:10,.0f} lifecycles/s")
    print(f"TP 8->8: {tp8:10,.0f} lifecycles/s  ({tp8 * 16:,.0f} endpoint-lifecycles/s)")
    print(json.dumps({"lifecycles_per_s_tp1": round(tp1), "lifecycles_per_s_tp8": round(tp8)}))


if __name__ == "__main__":
    main()
