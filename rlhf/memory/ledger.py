"""What is resident on the accelerator, as the code moves it: one ledger per process.

The decisions of a GPU step (which model state comes back for which phase, when colocated
servers release and wake their memory, what a build holds) are plain code; the moves they
order are the only GPU-only part. The code that decides records here, on the CPU exactly as
on a GPU, so that the CPU suite can assert the residency of every phase:

- the offload manager (`rlhf.engine.offload`): each model's `params`, `grads` and
  `optimizer` (owner "actor", "critic", "ref", ...; bytes: the storages' sizes, expert
  buffers included) when they come onto the device and when they leave it;
- the colocated servers' sleep and wake (`rlhf.rollout.policy_servers`): SGLang's
  `weights`, `kv_cache` and `cuda_graph` on this rank's GPU (owner "sglang"; bytes unknown
  here: the planner's);
- the step's phases (`phase(name)`: build, gen, old_log_prob, ref, values, update_critic,
  update_actor, update_weights): each phase's record holds everything resident at any
  moment inside it, and the largest sum of bytes resident at once.

One process is one device (a rank), so the ledger is process-wide, like the allocator it
mirrors (`ledger()`); `reset()` starts a new one (tests, a new run in the same process).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

Key = tuple[str, str]  # (owner, kind)
KEPT = 10_000  # phase records and events kept (a run's first steps, a long run's last)


@dataclass(frozen=True)
class PhaseRecord:
    """One occurrence of a phase: what was resident during it, and the peak bytes."""

    name: str
    held: frozenset[Key]
    peak_bytes: int

    def holds(self, owner: str, kind: str | None = None) -> bool:
        return any(o == owner and (kind is None or k == kind) for o, k in self.held)


@dataclass(frozen=True)
class Event:
    """A move: `action` "on" or "off" (or "phase" for a phase's start) at `time_s`
    (time.monotonic: comparable across the processes of one machine)."""

    time_s: float
    action: str
    owner: str
    kind: str


@dataclass
class Ledger:
    resident: dict[Key, int] = field(default_factory=dict)
    history: deque[PhaseRecord] = field(default_factory=lambda: deque(maxlen=KEPT))
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=KEPT))
    _open: list[tuple[str, set[Key], list[int]]] = field(default_factory=list)

    def came(self, owner: str, kind: str, nbytes: int = 0) -> None:
        """`owner`'s `kind` is on the device now (`nbytes` of it)."""
        self.resident[(owner, kind)] = nbytes
        self.events.append(Event(time.monotonic(), "on", owner, kind))
        self._note()

    def left(self, owner: str, kind: str) -> None:
        """`owner`'s `kind` is off the device now."""
        if self.resident.pop((owner, kind), None) is not None:
            self.events.append(Event(time.monotonic(), "off", owner, kind))

    def holds(self, owner: str, kind: str | None = None) -> bool:
        return any(o == owner and (kind is None or k == kind) for o, k in self.resident)

    @property
    def nbytes(self) -> int:
        return sum(self.resident.values())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Inside: phase `name`; its record (appended to `history` when it ends) holds all
        that was resident at any moment inside, nested phases included."""
        self.events.append(Event(time.monotonic(), "phase", name, ""))
        self._open.append((name, set(self.resident), [self.nbytes]))
        try:
            yield
        finally:
            name, held, peak = self._open.pop()
            self.history.append(PhaseRecord(name, frozenset(held), peak[0]))
            if self._open:  # the enclosing phase saw all of it too
                self._open[-1][1].update(held)
                self._open[-1][2][0] = max(self._open[-1][2][0], peak[0])

    def records(self, name: str) -> list[PhaseRecord]:
        return [r for r in self.history if r.name == name]

    def table(self) -> str:
        """The last record of each phase, in the order the phases last ended: what it held
        on the device, by owner, and its peak bytes (those the ledger knows)."""
        last = {r.name: r for r in self.history}
        rows = [f"{'phase':<16} {'peak MiB':>9}  held on the device"]
        for name, record in last.items():
            owners: dict[str, list[str]] = {}
            for owner, kind in sorted(record.held):
                owners.setdefault(owner, []).append(kind)
            held = "; ".join(f"{o}: {' '.join(k)}" for o, k in owners.items()) or "nothing"
            rows.append(f"{name:<16} {record.peak_bytes / 2**20:>9.1f}  {held}")
        return "\n".join(rows)

    def _note(self) -> None:
        for _, held, peak in self._open:
            held.update(self.resident)
            peak[0] = max(peak[0], self.nbytes)


_LEDGER = Ledger()


def ledger() -> Ledger:
    """This process's ledger."""
    return _LEDGER


def reset() -> Ledger:
    """A new, empty ledger for this process (what is resident is recorded anew from here)."""
    global _LEDGER
    _LEDGER = Ledger()
    return _LEDGER
