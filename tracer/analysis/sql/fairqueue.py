"""Who runs next in the query-worker pool: a per-client share and round robin between clients (issue 17).

First come, first served let one client starve the rest: twenty parallel 9-second queries from one MCP session
held both workers, and a ``select 1`` from another session waited 41 s, then failed as "busy". Here:

- a client (an MCP session, a connection, or the one caller of ``tracer sql``) holds at most ``per_client``
  workers at once (the pool's size less one), so a worker is always left for somebody else;
- when a worker frees up, the waiting client with the fewest running queries gets it; among equals the one served
  least recently (never first), then the longest waiting: a client that opened six sessions, each with a query
  queued ahead of another client's, no longer gets all six served before it (issue 30);
- a named client may have at most ``max_waiting`` queries waiting; more are refused at once instead of piling
  up threads in the server (the process's own caller, :data:`LOCAL_CLIENT`, waits for as many as it sends).

:class:`FairShare` only keeps the books. The pool calls it under its own lock and waits on its own condition.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tracer.analysis.sql.limits import SqlError

LOCAL_CLIENT = "local"  # the client of a caller that names none (tracer sql, tests)
SERVED_REMEMBERED = 4096  # clients whose last grant is remembered


@dataclass(eq=False)
class Ticket:
    """One query waiting for a worker."""

    client: str
    seq: int = field(default=0)


class FairShare:
    """The waiting queries and how many workers each client holds; not thread-safe (the pool's lock guards it).

    Args:
        per_client: most workers one client may hold at once.
        max_waiting: most queries of one client waiting at once; :meth:`enter` refuses more.
    """

    def __init__(self, per_client: int, max_waiting: int) -> None:
        self.per_client = max(1, per_client)
        self.max_waiting = max(0, max_waiting)
        self.running: dict[str, int] = {}
        self.waiting: list[Ticket] = []
        self._seq = itertools.count()
        self._grants = itertools.count()
        self.last_served: dict[str, int] = {}  # client -> the order of its last grant

    def enter(self, client: str | None) -> Ticket:
        """Queue a query of ``client``; raise :class:`SqlError` when that client already has too many waiting."""
        key = client or LOCAL_CLIENT
        queued = sum(1 for t in self.waiting if t.client == key)
        if queued >= self.max_waiting and key != LOCAL_CLIENT:
            raise SqlError(
                f"{queued + self.running.get(key, 0)} queries of this client are already running or waiting",
                f"Wait for their answers first: run_sql runs at most {self.per_client} of one client's queries at "
                f"once and queues {self.max_waiting} more.",
            )
        ticket = Ticket(key, next(self._seq))
        self.waiting.append(ticket)
        return ticket

    def next_up(self, eligible: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The waiting query that gets the next free worker: among clients under their share, the one running
        fewest queries, the one served least recently (never first), then the longest waiting; None when every
        waiting client holds its share.

        Args:
            eligible: only tickets it accepts are considered (the pool's: those that may take a worker of the
                kind free now, so a client kept out of the short lane does not hold up the one behind it).
        """
        allowed = [
            t
            for t in self.waiting
            if self.running.get(t.client, 0) < self.per_client and (eligible is None or eligible(t))
        ]
        return min(
            allowed,
            key=lambda t: (self.running.get(t.client, 0), self.last_served.get(t.client, -1), t.seq),
            default=None,
        )

    def grant(self, ticket: Ticket) -> None:
        """``ticket`` got a worker: it stops waiting and counts as running."""
        self.waiting.remove(ticket)
        self.running[ticket.client] = self.running.get(ticket.client, 0) + 1
        if len(self.last_served) >= SERVED_REMEMBERED:  # forget the clients served longest ago
            for c in sorted(self.last_served, key=self.last_served.__getitem__)[: SERVED_REMEMBERED // 2]:
                del self.last_served[c]
        self.last_served[ticket.client] = next(self._grants)

    def leave(self, ticket: Ticket) -> None:
        """``ticket`` gave up waiting (its deadline passed, or the pool closed)."""
        if ticket in self.waiting:
            self.waiting.remove(ticket)

    def done(self, client: str) -> None:
        """A query of ``client`` that held a worker finished (answered, failed or was killed)."""
        n = self.running.get(client, 0) - 1
        if n > 0:
            self.running[client] = n
        else:
            self.running.pop(client, None)
