"""One step's acceptance counts, in the shape `adaspec.telemetry.StepRecord` carries.

Counting rule (what `controller.acceptance` expects): at every node on a sequence's accepted
path, and at the node where its path stopped, the shape asked the drafter for `widths[d]`
children. Rank r at depth d is *reached* when its parent was accepted and ranks < r were
rejected; a candidate the drafter did not deliver (no n-gram match, a branch pruned by the
node budget) counts as reached and rejected, so measured rates include the drafter's
proposal rate and E(config) computed from them is the length this engine really gets.
Per position (chains, and the depth totals of trees): drafted[d] = sequences whose tree has
a node at depth d + 1; accepted[d] = sequences whose accepted path reached depth d + 1.
Per sequence (every step, in decode order): draft nodes verified and draft tokens accepted.
Under per-request budgets (`per_rank=False`) the ranks are not counted: a candidate left out
was left out by choice, and the kept ones were chosen for being likely, so rates per rank
would describe the selection, not the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from native_engine.tree import DraftTree
from native_engine.verify import Acceptance


@dataclass
class AcceptanceCounts:
    widths: tuple[int, ...]  # the shape the drafter was asked for
    per_rank: bool = True  # count reached / accepted per depth and rank
    num_drafts: int = 0  # sequences that verified at least one draft token
    drafted_per_pos: list[int] = field(default_factory=list)  # [depth - 1] -> sequences
    accepted_per_pos: list[int] = field(default_factory=list)  # [depth - 1] -> sequences
    reached: list[list[int]] = field(default_factory=list)  # [depth - 1][rank] -> sequences
    accepted: list[list[int]] = field(default_factory=list)  # [depth - 1][rank] -> sequences
    nodes_per_seq: list[int] = field(default_factory=list)  # [sequence] -> draft nodes verified
    accepted_per_seq: list[int] = field(default_factory=list)  # [sequence] -> draft tokens accepted

    def __post_init__(self) -> None:
        depth, width = len(self.widths), max(self.widths, default=0) if self.per_rank else 0
        self.drafted_per_pos = [0] * depth
        self.accepted_per_pos = [0] * depth
        self.reached = [[0] * width for _ in range(depth if self.per_rank else 0)]
        self.accepted = [[0] * width for _ in range(depth if self.per_rank else 0)]

    def add(self, tree: DraftTree, result: Acceptance) -> None:
        self.nodes_per_seq.append(len(tree))
        self.accepted_per_seq.append(result.num_accepted)
        if not self.widths:
            return
        if len(tree):
            self.num_drafts += 1
        for d in sorted(set(tree.depths())):
            self.drafted_per_pos[d - 1] += 1
        for d in range(result.num_accepted):
            self.accepted_per_pos[d] += 1
        if not self.per_rank:
            return
        for d, rank in enumerate(result.ranks):
            self.accepted[d][rank] += 1
            for r in range(rank + 1):
                self.reached[d][r] += 1
        stop = len(result.ranks)
        if stop < len(self.widths):
            for r in range(self.widths[stop]):
                self.reached[stop][r] += 1
