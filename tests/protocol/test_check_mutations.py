"""The model checker can fail: each test injects one known bug into the real
endpoints (a table row or a method, patched for the test alone) and expects the
checker to find it, on its own, with a trace.

The catalogue lives in :mod:`pushkv.protocol.check.mutations`: each mutation
names the scope that can reach the bug and the kind of broken promise it must
show; the search stops at the first violation of that kind.
"""

from __future__ import annotations

import pytest

from pushkv.protocol.check import explore
from pushkv.protocol.check.mutations import MAX_STATES, MUTATIONS, Patcher


@pytest.mark.parametrize(("mutate", "scope", "kind"), MUTATIONS,
                         ids=[f"{m[0].__name__}-{m[1].name}" for m in MUTATIONS])
def test_the_checker_finds_an_injected_bug(monkeypatch, mutate, scope, kind):
    mutate(monkeypatch)
    res = explore(scope, want=kind, max_states=MAX_STATES)
    assert res.violations, f"{mutate.__name__}: no {kind} violation in {res.summary()}"
    found = res.violations[0]
    assert found.kind == kind
    assert found.steps and len(found.story) >= len(found.steps)
    assert "!!" in found.story[-1] or "!!" in "".join(found.story)
    assert all(line.strip() for line in found.story)


def test_every_mutation_is_a_real_bug_of_its_own():
    """The unmutated core passes each mutation's search (else the test proves nothing)."""
    kinds = {}
    for mutate, scope, kind in MUTATIONS:
        kinds.setdefault((scope.name, kind), []).append(mutate.__name__)
    for (name, kind), muts in kinds.items():
        scope = next(s for _, s, _ in MUTATIONS if s.name == name)
        # As far as the mutations' own searches go (some scopes are larger than CI
        # explores to completion): the bug each one shows is not in the real core.
        res = explore(scope, want=kind, max_states=MAX_STATES)
        assert not res.violations, (muts, res.violations[0].report())


def test_the_patcher_undoes_every_mutation():
    """The library's patcher (used by the benchmark) leaves the endpoints as it found them."""
    from pushkv.protocol import records, states
    from pushkv.protocol.consumer import endpoint as consumer
    from pushkv.protocol.producer import view as producer_view

    before = (dict(states.CONSUMER_TABLE), dict(states.PRODUCER_TABLE),
              dict(states.SOURCE_TABLE), records.Attempt.landed, records.Attempt.all_fenced,
              producer_view.ProducerView._ack, consumer.Consumer.abandon,
              consumer.Consumer._from_producer)
    for mutate, _scope, _kind in MUTATIONS:
        with Patcher() as p:
            mutate(p)
    after = (dict(states.CONSUMER_TABLE), dict(states.PRODUCER_TABLE),
             dict(states.SOURCE_TABLE), records.Attempt.landed, records.Attempt.all_fenced,
             producer_view.ProducerView._ack, consumer.Consumer.abandon,
             consumer.Consumer._from_producer)
    assert after == before
