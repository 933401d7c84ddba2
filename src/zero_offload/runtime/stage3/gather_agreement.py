"""Stage-3 ranks that would gather different params are stopped before the gather, with an
error naming the params, instead of a collective that pairs different tensors (silently wrong
when the sizes agree, a transport abort when they do not).

Where ranks can diverge: a pass of a kind not seen before (no recorded order to follow), a
demand that departs from the recorded order (data-dependent modules), and a
``GatheredParameters`` block. There, and only there, each rank posts what it is about to gather
to the rendezvous store (TCPStore: a side channel that works even when the process group is
stuck) and waits for every rank's post of the same point:

- all ranks posted the same slots: go on (the gather is a matched collective);
- they posted different slots: every rank raises ``RankMismatchError`` naming each rank's
  params, at once;
- some rank did not post within the collective timeout (it followed the recorded order, or
  entered no block): this rank raises naming what it waited to gather and the ranks that did
  not come. Those ranks wait in their own next collective until it times out; its
  ``CollectiveError`` then says what this rank was waiting for (``explain``), read from the
  store.

Ranks that follow the recorded order never touch the store: no cost on the steady path.
Invariant: a point's key is unique per (kind, pass, position), posted once per rank; a rank
deletes its previous key once every rank posted the next one (all have read it by then).
"""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Callable

import torch.distributed as tdist

from ...core import dist
from ...core.consistency import RankMismatchError

PREFIX = "zero_offload/stage3/"
POLL_SECONDS = 0.5  # how often a waiting rank looks for a peer's failure report
# A waiting rank outwaits the collective timeout a little, so that the ranks stuck in a
# collective time out first and read its note while the store (on rank 0) is still up.
GRACE_SECONDS = 3.0
_created = 0  # agreements made in this process (each engine's keys are its own)
FIX = (
    "modules called depending on the data (Mixture-of-Experts experts) must be fetched whole: "
    "mark their block with zero_offload.utils.set_z3_leaf_modules or the "
    "zero_optimization.leaf_module config; every rank must run the same forwards "
    "(an evaluation on one rank only, too) and enter the same GatheredParameters blocks"
)


class GatherAgreement:
    def __init__(self, store, rank: int, world: int, describe: Callable[[str], str]) -> None:
        self.store, self.rank, self.world, self.describe = store, rank, world, describe
        self._previous: str | None = None
        explain = weakref.WeakMethod(self.explain)  # the note must not keep the engine alive
        self._remove_note = dist.add_failure_note(lambda c: (m := explain()) and m(c))
        weakref.finalize(self, self._remove_note)

    @classmethod
    def create(cls, describe: Callable[[str], str]) -> GatherAgreement | None:
        """None for a world of one or without a rendezvous store (then nothing is checked)."""
        if dist.world_size() <= 1:
            return None
        try:
            base = tdist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            return None
        global _created
        _created += 1  # the same count on every rank: engines are built collectively
        store = tdist.PrefixStore(f"{PREFIX}{_created}/", base)
        return cls(store, dist.rank(), dist.world_size(), describe)

    def close(self) -> None:
        self._remove_note()

    def _timeout(self) -> datetime.timedelta:
        """The collective timeout in force now (a rank may shorten it after start-up)."""
        return dist.current_timeout()

    def agree(self, point: str, value: str, where: str) -> None:
        """Every rank posts ``value`` (what it gathers) for ``point``; see the module doc."""
        mine = f"{point}/{self.rank}"
        self.store.set(f"waiting/{self.rank}", f"{where}: {self.describe(value)}")
        self.store.set(mine, value)
        keys = [f"{point}/{r}" for r in range(self.world)]
        values = self._wait(keys, where, value)
        if len(set(values)) > 1:
            which = "; ".join(
                f"rank {r}: the {self.describe(v)}" for r, v in enumerate(values) if v != values[0]
            )
            raise RankMismatchError(
                f"ranks gather different stage-3 params at {where}: rank 0: the "
                f"{self.describe(values[0])}; {which}. " + FIX
            )
        if self._previous is not None:
            self.store.delete_key(self._previous)
        self._previous = mine
        self.store.delete_key(f"waiting/{self.rank}")

    def _wait(self, keys: list[str], where: str, value: str) -> list[str]:
        """Every rank's value for ``keys``; raises when a rank does not come within the
        collective timeout, or as soon as one reports that its own collective failed (it
        followed another order: its collective had no partner)."""
        limit = self._timeout().total_seconds() + GRACE_SECONDS
        deadline = time.monotonic() + limit
        others = [f"failed/{r}" for r in range(self.world) if r != self.rank]
        failed, pause = None, 0.0005
        while failed is None and time.monotonic() < deadline:
            try:  # polled (a blocking wait would log a warning each time it expires)
                if self.store.check(keys):
                    return [v.decode() for v in self.store.multi_get(keys)]
                failed = [self.store.get(k).decode() for k in others if self.store.check([k])]
            except RuntimeError:  # the store (on rank 0) went away
                failed = ["rank 0 ended (with its own error)"]
            failed = failed or None
            time.sleep(pause)
            pause = min(2 * pause, POLL_SECONDS)
        why = "; ".join(failed) if failed else f"{limit:g} s passed"
        raise RankMismatchError(
            f"rank {self.rank}: at {where} this rank gathers the {self.describe(value)}, but "
            f"{self._missing(keys)} did not reach that point ({why}): they ran different "
            "modules or passes; " + FIX
        )

    def _missing(self, keys: list[str]) -> str:
        try:
            return f"rank(s) {[r for r, k in enumerate(keys) if not self.store.check([k])]}"
        except RuntimeError:  # the store is gone: rank 0 ended (with its own error)
            return "the other ranks"

    def explain(self, collective: str) -> str | None:
        """What other ranks are waiting to gather (for a collective that failed here); tells
        a waiting rank that this one failed, so it need not wait out its own timeout."""
        notes = []
        self.store.set(f"failed/{self.rank}", f"rank {self.rank}'s {collective} failed")
        for r in range(self.world):
            key = f"waiting/{r}"
            if r == self.rank or not self.store.check([key]):
                continue
            notes.append(f"rank {r} is waiting at {self.store.get(key).decode()}")
        if not notes:
            return None
        return (
            "; ".join(notes)
            + " (not the order this rank followed: ranks ran different modules; "
            + FIX
            + ")"
        )
