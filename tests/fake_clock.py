"""A fake clock for tests that pin orderings of timed calls without depending on the machine's speed.

:class:`FakeClock` stands in for ``time.perf_counter`` where aitune reads its clock (``aitune.torch.measure.profiling.use_clock``,
``aitune.torch.jit.inspection_records._clock``; the ``fake_clock`` fixture in ``tests/conftest.py`` installs it). Its time
moves only when the code under test says so: :func:`pause` (in place of ``time.sleep``) moves it by the given
seconds, and every reading moves it by one ``tick_s`` (1 us), so no call takes zero time. Real work (a tiny
model's forward) takes no time at all on it: a call's measured duration is exactly its pauses plus the readings
made inside it.
"""

from __future__ import annotations


class FakeClock:
    """Seconds, monotonic; advances by ``tick_s`` per reading and by :meth:`sleep`'s argument."""

    def __init__(self, start_s: float = 1000.0, tick_s: float = 1e-6):
        self.now = start_s
        self.tick_s = tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now

    def nanoseconds(self) -> int:
        """A reading in integer ns, as ``time.perf_counter_ns`` gives (what ``aitune.torch.measure.profiling.use_clock``
        takes)."""
        return round(self() * 1e9)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


_INSTALLED: list[FakeClock] = []


def install(clock: FakeClock | None) -> None:
    """Make ``clock`` the one :func:`pause` moves (None: no fake clock; :func:`pause` then raises)."""
    _INSTALLED[:] = [clock] if clock is not None else []


def pause(seconds: float) -> None:
    """``time.sleep`` for code timed on the fake clock: moves it by ``seconds`` and returns at once."""
    if not _INSTALLED:
        raise RuntimeError("pause() needs the fake_clock fixture (tests/conftest.py): it moves the fake clock only")
    _INSTALLED[0].sleep(seconds)
