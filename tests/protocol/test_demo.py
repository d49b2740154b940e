"""The guided tour (``pushkv demo``) holds what it prints: bytes and no leaks."""

from pushkv import demo


def test_every_demo_scenario_holds():
    lines: list[str] = []
    assert demo.run(lines.append)
    assert sum("bytes match the source, no blocks leaked" in line for line in lines) == len(
        demo.SCENARIOS)


def test_the_reused_id_scenario_drops_the_old_notification():
    net, _ = demo.reused_id()
    (c,) = net.consumers.values()
    assert c.endpoint.stats["stale"] == 1
    assert [kind for kind, _ in c.outcomes["req-6"]] == ["ready", "ready"]
