"""When to probe and with which batches: shared by :class:`~fslr_func.training.recorder.Recorder`
and :class:`~fslr_func.training.flerm.FLeRM`.

A :class:`ProbePlan` says how many probe batches each training step gets (an EMA warm-up at
the first probed step, then one every ``every`` steps); a :class:`ProbeFeed` hands them out
from the user's iterable and counts them, so that a resumed run draws the same batches as an
uninterrupted one.

Examples:
    >>> plan = ProbePlan.of(warmup_samples=16, samples=8, every=2, start_step=1)
    >>> feed = ProbeFeed(iter([10, 11, 12, 13]))
    >>> [feed.take(plan.probes_at(t)) for t in range(6)]
    [[], [10, 11], [], [12], [], [13]]
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..probe.functional import Inputs
from ..stats.checks import integer

__all__ = ["ProbeFeed", "ProbePlan", "length_of"]


@dataclass(frozen=True)
class ProbePlan:
    """When to probe: a warm-up at ``start_step``, then one probe every ``every`` steps.

    Attributes:
        warmup_probes: probes (fresh batches, same update) at ``start_step``.
        every: period of the single probes after the warm-up; ``None``: warm-up only.
        start_step: the first probed step; earlier steps are not probed.

    Examples:
        >>> plan = ProbePlan.of(warmup_samples=40, samples=8, every=100, start_step=5)
        >>> [plan.probes_at(t) for t in (0, 5, 6, 105, 205, 206)]
        [0, 5, 0, 1, 1, 0]
    """

    warmup_probes: int
    every: int | None
    start_step: int

    @classmethod
    def of(cls, warmup_samples: int, samples: int, every: int | None, start_step: int) -> ProbePlan:
        """Validate the options; ``warmup_probes = ceil(warmup_samples / samples)``.

        Raises:
            ValueError: ``warmup_samples`` or ``every`` not a positive integer, or
                ``start_step`` negative.
        """
        warmup_samples = integer(warmup_samples, "warmup_samples", low=1)
        if every is not None:
            every = integer(every, "every", low=1, optional=True)
        start_step = integer(start_step, "start_step", low=0)
        return cls(math.ceil(warmup_samples / samples), every, start_step)

    def probes_at(self, step: int) -> int:
        """Number of probe batches at ``step`` (0 on steps that are not probed)."""
        if step == self.start_step:
            return self.warmup_probes
        after = step - self.start_step
        return int(self.every is not None and after > 0 and after % self.every == 0)


def length_of(source: object) -> int | None:
    """``len(source)``, or ``None`` where it has none (an iterator, a ``DataLoader`` over an
    ``IterableDataset``)."""
    try:
        return len(source)  # type: ignore[arg-type]
    except TypeError:
        return None


class ProbeFeed:
    """Draws probe batches from an iterable, counting them so that a resumed run can skip them.

    Two kinds of source work: an endless iterator (a generator over shuffled batches), and a
    re-iterable (a ``DataLoader``, a list, a dataset of batches), which is started again each
    time it runs out, with a note the first time (probe batches then repeat; shuffle the
    loader to vary them). A one-shot iterator that runs out is an error.

    The iterator is created at the first draw; after :meth:`skip` (a resume) it first discards
    the batches the interrupted run used, so a deterministic iterable re-created from scratch
    (e.g. ``experiments.batches(..., generator=seed)``) yields the same batches as an
    uninterrupted run. One tensor is refused (``TypeError``): iterated, its rows would be
    probe batches of one example each; so is one dict, which yields its keys; so is a source
    of length 0 (``ValueError``). A batch
    that is a list, as a ``DataLoader`` over a dataset of tuples (``TensorDataset``) yields,
    is handed out as a tuple: the model's positional arguments. Drawing never advances the
    global (CPU) RNG, which a ``DataLoader`` draws a seed from at every pass (and a shuffling
    one its order): training sees the same dropout masks and shuffles with probes as without,
    and a resumed run the same as an uninterrupted one.

    Examples:
        >>> feed = ProbeFeed(iter(range(10)))
        >>> feed.take(2), feed.take(1), feed.used
        ([0, 1], [2], 3)
        >>> again = ProbeFeed(iter(range(10)))
        >>> again.skip(3)
        >>> again.take(2)
        [3, 4]
        >>> again.give_back([3, 4])  # not measured (a skipped step): handed out again
        >>> again.used, again.take(3)
        (3, [3, 4, 5])
    """

    def __init__(self, batches: Iterable[Inputs]) -> None:
        if isinstance(batches, torch.Tensor):
            raise TypeError(
                "probe_batches is one tensor: iterated, each of its rows would be a probe batch "
                "of one example; pass a list of batches ([x]), or an iterable of them"
            )
        if isinstance(batches, Mapping):
            raise TypeError(
                "probe_batches is one dict (keyword arguments of one batch?): iterated, it "
                "yields its keys, not batches; pass a list of batches ([batch]), or an "
                "iterable of them"
            )
        if length_of(batches) == 0:
            raise ValueError(
                "probe_batches is empty: it yields no probe batch; pass held-out model inputs "
                "(a non-empty list of batches, dataset or DataLoader)"
            )
        self._source = batches
        self._cycles = not isinstance(batches, Iterator)
        self._it: _Counting | None = None
        self._pending = 0
        self._noted = False
        self._returned: list[Inputs] = []
        self.used = 0

    def check_skip(self, used: int) -> None:
        """Refuse a resume after ``used`` batches that a one-shot iterator already drawn
        from cannot give: it cannot start again (a state loaded back into the live objects,
        a rollback, would skip ``used`` batches from where the run stopped, not from the
        start).

        Raises:
            ValueError: the source is a one-shot iterator, drawn from, at another position.
        """
        if not self._cycles and self._it is not None and used != self.used:
            raise ValueError(
                f"the probe batches are a one-shot iterator (a generator) that this run has "
                f"drawn {self.used} batches from, and the state resumes after {used}: it "
                "cannot start again. Load the state into freshly built objects with a fresh "
                "iterator, or give probe batches that can be gone through again (a list, a "
                "DataLoader)"
            )

    def skip(self, used: int) -> None:
        """Resume after ``used`` batches: they are discarded from a fresh iterator at next draw
        (a one-shot iterator drawn from is at that position already: :meth:`check_skip`)."""
        self.check_skip(used)
        if not self._cycles and self._it is not None:
            return
        self._it = None
        self._returned = []
        self._pending = used
        self.used = used

    def give_back(self, batches: list[Inputs]) -> None:
        """Batches of a step that was not measured: the next :meth:`take` hands them out
        first, and they are not counted as used (a resume draws them again)."""
        self._returned = batches + self._returned
        self.used -= len(batches)

    def take(self, n: int) -> list[Inputs]:
        """The next ``n`` probe batches.

        Raises:
            ValueError: a one-shot iterator ran out, or a re-iterable yields nothing.
        """
        if self._returned:
            out, self._returned = self._returned[:n], self._returned[n:]
            self.used += len(out)
            if len(out) == n:
                return out
            try:
                return out + self.take(n - len(out))
            except BaseException:
                self.give_back(out)  # a source that raised mid-draw loses no batch
                raise
        with torch.random.fork_rng(devices=[]):
            if self._it is None:
                self._it = _Counting(iter(self._source))
                try:
                    skipped = self._draw(self._pending, keep=False)
                except BaseException:
                    self._it = None  # the skip is redone at the next draw
                    raise
                if len(skipped) < self._pending:
                    raise ValueError(
                        f"probe_batches has fewer than the {self._pending} batches the "
                        "checkpointed run used: hand in the same (re-created) iterable"
                    )
                self._pending = 0
            out = self._draw(n)
        if len(out) < n:
            raise ValueError(
                f"probe_batches ran out after {self.used + len(out)} batches: hand in an endless "
                "iterator of probe inputs (e.g. a generator over shuffled batches) or a "
                "re-iterable such as a DataLoader, which is cycled"
            )
        self.used += n
        return out

    def _draw(self, n: int, *, keep: bool = True) -> list[Inputs]:
        """The next ``n`` batches from the source (lists as tuples of positional arguments),
        cycling a re-iterable; fewer where a one-shot iterator runs out. If the source raises
        (a transient read error), the batches drawn before are kept for the next draw
        (``keep``; a resume's skip is redone instead)."""
        assert self._it is not None
        out: list[Inputs] = []
        try:
            out += itertools.islice(self._it, n)
            while len(out) < n and self._cycles:
                one_pass = self._it.count
                self._it = _Counting(iter(self._source))
                before = len(out)
                out += itertools.islice(self._it, n - len(out))
                if len(out) == before:
                    raise ValueError("probe_batches is empty: it yields no probe batch")
                if not self._noted:
                    self._noted = True
                    warnings.warn(
                        f"probe_batches ran out after one pass ({one_pass} batches); it is "
                        "started again, so probe batches repeat (shuffle it to vary them)",
                        RuntimeWarning,
                        stacklevel=4,
                    )
        except BaseException:
            if keep:
                self._returned = [*_as_inputs(out), *self._returned]
            raise
        return _as_inputs(out)


class _Counting:
    """An iterator that counts the items it has handed out (one pass of a re-iterable); an
    error of the source passes through and leaves it usable, as the source is."""

    def __init__(self, source: Iterator[Inputs]) -> None:
        self.source, self.count = source, 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Inputs:
        item = next(self.source)
        self.count += 1
        return item


def _as_inputs(batches: list[Any]) -> list[Inputs]:
    """Batches as the model takes them: a list (a ``TensorDataset``'s row) as a tuple of
    positional arguments."""
    return [tuple(b) if isinstance(b, list) else b for b in batches]
