"""DeepSpeed's ``RepeatingLoader``: an endless iterator over a data loader."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Iterate ``loader`` forever: when it is exhausted, start it again (a ``DataLoader`` with
    a ``DistributedSampler`` reshuffles only if the caller advances its epoch)."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader stops here, as DeepSpeed's does
