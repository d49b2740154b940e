"""Packed writes in the simulator: the transports' cost model decides per write."""

import dataclasses

from sim_helpers import config, with_profile

from pushkv.protocol.packing import choose
from pushkv.sim.packing import SIM_PACKING, StagingLedger
from pushkv.sim.profile import DEFAULT
from pushkv.sim.runner import run


def go(mode: str, fragmentation: float) -> dict:
    prof = with_profile(prefill={"fragmentation": fragmentation},
                        decode={"fragmentation": fragmentation})
    return run(config("push", qps=4.0, input_len=16384, output_len=8, num_prompts=12,
                      profile=prof, packing=dataclasses.replace(SIM_PACKING, mode=mode))).result


def test_fragmented_cache_packs_and_posts_far_less():
    direct, packed = go("never", 0.2), go("auto", 0.2)
    assert direct["pushkv"]["packed_writes"] == 0
    assert packed["pushkv"]["packed_writes"] > 0
    assert packed["pushkv"]["prefill_post_ms"] < direct["pushkv"]["prefill_post_ms"] / 5
    assert packed["completed"] == direct["completed"] == 12


def test_contiguous_cache_stays_direct_under_auto():
    r = go("auto", 0.0)
    assert r["pushkv"]["packed_writes"] == 0


def test_the_simulator_decides_with_the_profiles_posting_cost():
    ledger = StagingLedger(SIM_PACKING, DEFAULT.network)
    assert ledger.config.post_per_descriptor_s == DEFAULT.network.post_per_descriptor_s
    cfg = dataclasses.replace(ledger.config, mode="auto")
    ledger = StagingLedger(cfg, DEFAULT.network)
    want = choose(ledger.config, descriptors=131_072, nbytes=512 << 20,
                  staging_free=cfg.staging_bytes)
    got = ledger.decide("p", "d", 131_072, 512 << 20)
    assert got == want and got.packed
    # staging in use on either side is not free for the next write
    assert ledger.decide("p", "x", 131_072, cfg.staging_bytes).reason == "staging"
    ledger.give_back("p", "d", 512 << 20)
    assert ledger.used["p"] == ledger.used["d"] == 0
