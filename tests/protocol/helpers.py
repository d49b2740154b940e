"""A pair helper: drive producer and consumer endpoints by hand, with a clock."""

from __future__ import annotations

from pushkv.protocol import (
    Consumer,
    ConsumerConfig,
    IssueWrite,
    Producer,
    ProducerConfig,
    SendMessage,
    uniform_ranks,
)


class Pair:
    """Producer ranks of engine "P" and consumer ranks of engine "D", handshakes done.

    Nothing moves on its own: tests call endpoint methods, then route what they
    want with :meth:`to_producers` / :meth:`to_consumers`, seeing every action.
    """

    def __init__(self, producer=None, consumer=None, pcfg=None, ccfg=None):
        self.now = 0.0
        self.p = [Producer(i, pcfg or ProducerConfig()) for i in
                  uniform_ranks("P", **(producer or {}))]
        self.c = [Consumer(i, ccfg or ConsumerConfig()) for i in
                  uniform_ranks("D", **(consumer or {}))]
        for p in self.p:
            for c in self.c:
                p.add_peer(c.info)
                c.add_peer(p.info)

    def to_producers(self, actions):
        """Deliver every SendMessage to its producer; return what they answered."""
        out = []
        for a in actions:
            if isinstance(a, SendMessage) and a.peer.engine_id == "P":
                out += self.p[a.peer.rank].receive(a.message, self.now)
        return out

    def to_consumers(self, actions):
        out = []
        for a in actions:
            if isinstance(a, SendMessage) and a.peer.engine_id == "D":
                out += self.c[a.peer.rank].receive(a.message, self.now)
        return out

    def complete(self, writes, ok=True):
        """Finish IssueWrites: report to the producer, deliver the notification."""
        back, notes = [], []
        for w in writes:
            if isinstance(w, IssueWrite):
                p = next(p for p in self.p if p.peer.rank == w.notify.rank)
                back += p.write_completed(w.transfer_id, w.attempt, w.peer, ok, self.now)
                if ok:
                    notes += self.c[w.peer.rank].receive(w.notify, self.now)
        return back, notes


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def msgs(actions, kind):
    return [a.message for a in actions if isinstance(a, SendMessage)
            and isinstance(a.message, kind)]


class deadline:
    """Fail (instead of hanging) if the block runs longer than ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        import signal

        def expired(signum, frame):
            raise AssertionError(f"did not finish within {self.seconds} s (a timer loop?)")

        self._old = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        import signal

        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._old)
        return False
