"""The reducer's event stream: what happened in a step, as ``(event, ident, time)`` records.

The reducer emits a record at each point of a step (:data:`EVENTS`, in the order a step emits
them); who listens is kept here. The timeline, ``ddp.trace()``, torch's logging timers, the
consistency checks and the late-gradient watch are listeners, each in its own module. A record
nobody listens to costs one dictionary look-up, and a listener that is a list's own ``append``
(the timeline, the logger's sampled steps) runs no Python at all.
"""

from __future__ import annotations

#: The events, in the order a step emits them. ``ident`` is a parameter index for ``ready`` and
#: ``late_gradient``; a bucket index for ``launch``, ``done``, ``waited`` and ``wait_failed``;
#: 1 or 0 (synchronized or not) for ``forward``; the iteration's number for ``sampled`` (an
#: iteration torch's logger times: see :mod:`miniddp.compat.logging_data`); else -1. The error a
#: ``wait_failed`` or ``error`` names is the reducer's ``error``.
EVENTS = ("rebuild", "forward", "sampled", "forward_end", "ready", "launch", "done", "used_flags",
          "backward_end", "waited", "wait_failed", "finalized", "late_gradient", "buffers",
          "error")

#: What the timeline records: a backward's events, and any other a caller records (None).
TIMELINE_EVENTS = ("ready", "launch", "done", "backward_end", "waited", "finalized", None)


class EventStream:
    """Who listens to which of a reducer's events. The reducer emits them, and so may its DDP
    module, the errors and a lesson: ``Reducer.emit`` (in the engine's file, so that one step
    reads in the engine's three)."""

    def __init__(self):
        self._listeners: dict[str, list] = {}  # event -> callables
        self._others: tuple = ()  # the listeners of every event, for any not in EVENTS

    def subscribe(self, listener, events=None) -> None:
        """Call ``listener((event, ident, time.perf_counter()))`` at each of ``events`` (every
        event when None; see :data:`EVENTS`)."""
        for event in EVENTS if events is None else events:
            self._listeners.setdefault(event, []).append(listener)
        if events is None or None in events:
            self._others += (listener,)

    def unsubscribe(self, listener) -> None:
        kept = {event: [f for f in fs if f != listener]
                for event, fs in self._listeners.items()}
        self._listeners = {event: fs for event, fs in kept.items() if fs}
        self._others = tuple(f for f in self._others if f != listener)

    @property
    def timeline(self) -> list[tuple] | None:
        """A backward's events as ``(event, ident, time)`` (:data:`TIMELINE_EVENTS`), when set
        to a list (lessons, traces)."""
        return self.__dict__.get("_timeline")

    @timeline.setter
    def timeline(self, records: list[tuple] | None) -> None:
        if self.__dict__.get("_timeline") is not None:
            self.unsubscribe(self._timeline_append)
        self._timeline = records
        if records is not None:
            self._timeline_append = records.append
            self.subscribe(self._timeline_append, TIMELINE_EVENTS)
