"""Token trees as data: a parents array, and the mask / positions derived from it.

Terms (docs/papers.md section 3; EAGLE-2, Li et al. 2024; SpecInfer, Miao et al. 2024)
- root: the sequence's last sampled token, not yet in the KV cache. Draft nodes hang below
  it; node i's parent is `parents[i]` (-1 = the root), nodes in topological order, siblings
  in the drafter's rank order (rank 0 = its most likely candidate).
- depth: 1 for the root's children. A node's RoPE position is prefix length + depth.
- shape: widths per depth (the `SpecConfig` of adaspec.policy: (4, 2, 2, 1) = the root gets
  4 children, each of those 2, ...), optionally with a node budget: expand by the widths,
  then keep the `budget` nodes with the highest path probability (EAGLE-2's re-ranking).
  A child's path probability never exceeds its parent's, so the kept set is a subtree.
- verify layout: row 0 is the root, row i + 1 is node i.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaspec.policy import SpecConfig


@dataclass(frozen=True)
class TreeShape:
    """What the drafter is asked for in one step."""

    widths: tuple[int, ...]  # children per expanded node, per depth; () = no speculation
    budget: int | None = None  # keep at most this many nodes, best-first; None = all

    @classmethod
    def from_config(cls, config: SpecConfig, budget: int | None = None) -> TreeShape:
        # A chain has one node per depth: a budget below its length only shortens it.
        return cls(widths=tuple(config.widths), budget=budget)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def full_nodes(self) -> int:
        """Nodes of the full tree the widths describe (root excluded)."""
        return SpecConfig(widths=self.widths).num_nodes

    @property
    def expanded_nodes(self) -> int:
        """Most nodes a drafter creates for this shape: with a budget, only nodes still among
        the best `budget` get children, so a level has at most budget x width nodes."""
        total, level = 0, 1
        for width in self.widths:
            parents = level if self.budget is None else min(level, self.budget)
            level = parents * width
            total += level
        return total

    @property
    def max_nodes(self) -> int:
        """Most nodes a drafter may return for this shape (tokens verified besides the root)."""
        return self.full_nodes if self.budget is None else min(self.budget, self.full_nodes)

    def __str__(self) -> str:
        name = str(SpecConfig(widths=self.widths))
        return name if self.budget is None or self.budget >= self.full_nodes else f"{name}@{self.budget}"


@dataclass
class DraftTree:
    """One sequence's draft: node tokens, parents, and the drafter's path probabilities."""

    tokens: list[int] = field(default_factory=list)  # [N] token ids
    parents: list[int] = field(default_factory=list)  # [N] parent node, -1 = root
    scores: list[float] = field(default_factory=list)  # [N] drafter's P(path root -> node)
    match_len: int = 0  # prompt lookup: tokens of the suffix it matched (0: another drafter)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        out: list[int] = []
        for i, p in enumerate(self.parents):
            if p >= i:
                raise ValueError(f"parents must be topologically ordered: node {i} has parent {p}")
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """children[0] = the root's children, children[i + 1] = node i's; in rank order."""
        out: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out


def best_nodes(tree: DraftTree, budget: int) -> list[int]:
    """The `budget` nodes with the highest score (ties: earlier node first), in node order."""
    return sorted(sorted(range(len(tree)), key=lambda i: (-tree.scores[i], i))[:budget])


def prune_best_first(tree: DraftTree, budget: int) -> DraftTree:
    """Keep the `budget` nodes with the highest path probability (ties: earlier node first).

    A parent precedes its children in topological order and scores no less, so the kept set
    always contains each kept node's ancestors."""
    if len(tree) <= budget:
        return tree
    return subtree(tree, best_nodes(tree, budget))


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (ascending, each kept node's parent kept too) as a tree of their own."""
    if len(keep) == len(tree):
        return tree
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=[tree.tokens[i] for i in keep],
        parents=[-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in keep],
        scores=[tree.scores[i] for i in keep],
        match_len=tree.match_len,
    )


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: row i sees column j iff j is i itself or an ancestor (row 0 = root).

    EAGLE-2's recurrence: mask[i + 1] = mask[parent + 1] | self."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i + 1] |= mask[p + 1]
    return mask


def batch_tree_inputs(trees: list[DraftTree], roots: list[int], lengths: list[int], pad_token: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one verify pass over B sequences, padded to T = 1 + max nodes.

    Returns tokens [B, T], RoPE positions [B, T] (length + depth), write positions [B, T]
    (length + row: consecutive cache positions) and the tree block of the mask [B, T, T].
    Pad rows see only themselves and sit after the real rows, so real rows never see them."""
    B = len(trees)
    T = 1 + max((len(t) for t in trees), default=0)
    tokens = torch.full((B, T), pad_token, dtype=torch.long)
    depth = torch.zeros((B, T), dtype=torch.long)
    block = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    for b, tree in enumerate(trees):
        n = len(tree) + 1
        tokens[b, 0] = roots[b]
        tokens[b, 1:n] = torch.tensor(tree.tokens, dtype=torch.long)
        depth[b, 1:n] = torch.tensor(tree.depths(), dtype=torch.long)
        block[b, :n, :n] = tree_mask(tree.parents)
    start = torch.tensor(lengths, dtype=torch.long)[:, None]
    return tokens, start + depth, start + torch.arange(T)[None, :], block


def attention_mask(block: torch.Tensor, lengths: torch.Tensor, key_len: int,
                   tokens_per_row: list[int] | None = None) -> torch.Tensor:
    """Full mask [B, 1, Tq, key_len]: each new token sees its row's committed prefix (cache
    positions < length) plus the block [B, Tq, Tk], whose columns are cache positions
    length .. length + Tk - 1 (Tk = Tq when the block is the new tokens themselves).
    tokens_per_row: a row's tokens after its first tokens_per_row[b] are pads (their outputs
    are dropped): they see only the block, so the attention kernel skips the prefix for them
    (native_engine/csrc/decode_attention.cpp, `run`)."""
    B, Tq, Tk = block.shape
    keys = torch.arange(key_len, device=block.device)
    sees_prefix = torch.ones(B, Tq, 1, dtype=torch.bool, device=block.device)
    if tokens_per_row is not None:
        real = torch.tensor(tokens_per_row, device=block.device)
        sees_prefix = (torch.arange(Tq, device=block.device)[None, :] < real[:, None])[:, :, None]
    mask = (keys[None, None, :] < lengths[:, None, None]) & sees_prefix
    cols = (lengths[:, None] + torch.arange(Tk, device=block.device)[None, :])[:, None, :].expand(B, Tq, Tk)
    mask.scatter_(2, cols, block)
    return mask[:, None]
