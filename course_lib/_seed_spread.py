"""``SeedSpread`` (lesson 04), beside ``course_lib.train``, which re-exports it: one result of a
training run measured over several seeds, so that a claim about learning rests on its spread.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["SeedSpread"]


@dataclass(frozen=True)
class SeedSpread:
    """One result of a training run (a final test accuracy, say), measured once per seed.

    Runs that differ only in the seed (the initial weights, the order of the batches) end at
    different numbers; a claim about learning is drawn from several seeds with their spread.
    ``str()`` gives ``median 0.812 (lowest 0.791, highest 0.826) over 3 seeds``.

    Attributes:
        values: one number per seed, in the order of the seeds.
    """

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        values = tuple(float(v) for v in self.values)
        if not values or not all(math.isfinite(v) for v in values):
            raise ValueError(f"SeedSpread needs at least one finite number (one per seed), got "
                             f"{list(self.values)}; leave out runs that produced no result.")
        object.__setattr__(self, "values", values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lowest(self) -> float:
        return min(self.values)

    @property
    def highest(self) -> float:
        return max(self.values)

    def __str__(self) -> str:
        n = len(self.values)
        return (f"median {self.median:.3f} (lowest {self.lowest:.3f}, highest "
                f"{self.highest:.3f}) over {n} seed{'s' if n > 1 else ''}")

    def chance_apart(self, other: SeedSpread) -> float:
        """How often two ranges this size fall apart (no overlap) by the seeds alone.

        If the two settings did not differ, the ``n + m`` runs would be exchangeable and each
        of the ``C(n + m, n)`` ways to split them into the two groups as likely: only two of
        them (all of one above all of the other, either way) leave the ranges apart. With 3
        seeds each that is 2 in 20: three seeds are weak evidence, more give stronger.
        """
        return min(1.0, 2 / math.comb(len(self.values) + len(other.values), len(self.values)))

    def verdict(self, name: str, other: SeedSpread, other_name: str) -> str:
        """One sentence: ``name`` higher or lower than ``other_name`` on every seed, or "overlap".

        A difference is named only when the ranges do not overlap (every run of one above every
        run of the other), with ``chance_apart``; otherwise no difference these seeds can show.
        """
        ranges = (f"[{self.lowest:.3f}, {self.highest:.3f}] against "
                  f"[{other.lowest:.3f}, {other.highest:.3f}]")
        if self.lowest > other.highest or self.highest < other.lowest:
            word = "higher" if self.lowest > other.highest else "lower"
            return (f"{name} is {word} than {other_name} on every seed ({ranges}; ranges this "
                    f"far apart come from the seeds alone with probability "
                    f"{self.chance_apart(other):.2f})")
        return (f"{name} against {other_name}: the ranges overlap ({ranges}), no difference "
                f"these seeds can show")
