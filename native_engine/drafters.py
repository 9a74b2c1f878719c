"""Drafters: who proposes the token tree a verify step checks.

- `NgramDrafter` (prompt lookup; Saxena 2023, vLLM's `ngram`): find earlier occurrences of
  the context's last n tokens; the tokens that followed each occurrence are candidate
  continuations. Continuations are merged into a trie; at each node the children are ranked
  by how many occurrences agree (ties: the most recent), so different matches give
  different branches. A node's score is the fraction of occurrences through it.
- `DraftModelDrafter`: a smaller model of the same family (same code as the target), with
  its own KV cache in the engine's row layout. Each depth is one forward over the previous
  depth's nodes (tree attention), and each node's top-w tokens become its children; a
  node's score is the product of draft probabilities along its path (EAGLE-2's ranking).

A drafter returns one `DraftTree` per sequence, siblings in rank order, never more nodes
than `shape.max_nodes` nor deeper than `shape.depth`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from native_engine.kv_cache import KVCache
from native_engine.model import Transformer
from native_engine.tree import DraftTree, TreeShape, attention_mask, best_nodes, prune_best_first


class Drafter(Protocol):
    name: str  # telemetry's draft_method: "ngram" | "draft_model"
    max_depth: int  # deepest tree it can draft (tokens)
    max_expanded_nodes: int  # most nodes it can create for one tree (TreeShape.expanded_nodes)
    budget_offer: tuple[int, ...]  # widths of the candidate tree it offers under per-request budgets

    def propose(self, contexts: list[list[int]], shape: TreeShape) -> list[DraftTree]:
        """contexts[b]: the committed tokens of the sequence in row b, ending with the root."""
        ...

    def move_row(self, src: int, dst: int) -> None: ...

    def reset_row(self, row: int) -> None: ...


# ----------------------------------------------------------------------------------- n-gram
@dataclass
class NgramDrafter:
    max_n: int = 4  # longest suffix matched (tokens)
    min_n: int = 2  # shortest; 1-grams match too often to be worth verifying
    max_matches: int = 32  # most recent occurrences considered
    max_depth: int = 16
    max_expanded_nodes: int = 1 << 20  # stateless: only the matches it finds bound the tree
    name: str = "ngram"
    # Matches are cheap and bound the tree themselves: offer wide near the root and deep
    # below it (a copied line runs long). A chain-shaped offer, (2,) + (1,) * 11, did worse
    # at batch 1 and no better at batch 4 (bench/results/budget-cpu at commit 1dcc68e,
    # and docs/benchmarks.md there).
    budget_offer: tuple[int, ...] = (4, 2, 2) + (1,) * 9

    def propose(self, contexts: list[list[int]], shape: TreeShape) -> list[DraftTree]:
        return [self._propose_one(ctx, shape) for ctx in contexts]

    def move_row(self, src: int, dst: int) -> None:  # stateless
        pass

    def reset_row(self, row: int) -> None:
        pass

    def match(self, ctx: list[int], depth: int) -> tuple[int, list[list[int]]]:
        """(n, runs): the longest suffix length n that occurs earlier, and the token runs (up to
        `depth` long) that followed its earlier occurrences, most recent first."""
        if depth == 0 or len(ctx) < self.min_n + 1:
            return 0, []
        seq = torch.tensor(ctx, dtype=torch.long)
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram except the suffix itself
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten().tolist()
            if hits:
                starts = [h + n for h in reversed(hits)][: self.max_matches]
                return n, [ctx[s: s + depth] for s in starts if s < len(ctx)]
        return 0, []

    def _propose_one(self, ctx: list[int], shape: TreeShape) -> DraftTree:
        n, runs = self.match(ctx, shape.depth)
        tree = DraftTree(match_len=n)
        if not runs:
            return tree
        total = len(runs)
        # frontier: (node id or -1 for the root, runs passing through it)
        frontier: list[tuple[int, list[list[int]]]] = [(-1, runs)]
        for d, width in enumerate(shape.widths):
            nxt = []
            for parent, through in frontier:
                groups: dict[int, list[list[int]]] = {}  # insertion order = recency
                for run in through:
                    if len(run) > d:
                        groups.setdefault(run[d], []).append(run)
                ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:width]  # stable: recency
                for token, group in ranked:
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    tree.scores.append(len(group) / total)
                    nxt.append((len(tree.tokens) - 1, group))
            frontier = nxt
        return prune_best_first(tree, shape.budget) if shape.budget is not None else tree


# ----------------------------------------------------------------------------------- draft model
class DraftModelDrafter:
    """Top-w expansion with a small draft model; its cache rows mirror the engine's rows."""

    name = "draft_model"
    budget_offer = (4, 2, 1, 1, 1)  # one draft pass per depth: offer shallower than prompt lookup

    def __init__(self, model: Transformer, rows: int, max_len: int, max_depth: int = 8,
                 max_expanded_nodes: int = 128):
        """rows, max_len: the engine's KV-cache rows and positions per row (tokens)."""
        self.model = model
        self.max_depth = max_depth
        self.max_expanded_nodes = max_expanded_nodes
        a = model.args
        w = model.lm_head.weight
        # Room after a sequence for every expanded node plus one pad column per frontier row,
        # and for a catch-up pass's pads: in `_catch_up` every row runs as many tokens as the
        # row with the most to feed (a new row's whole prompt), its pads written after its own
        # tokens, so a long row beside a new one needs max_len more (found at batch 16 under
        # `auto`: "the pass reads 1293 keys of 1280").
        length = 2 * max_len + 2 * max_expanded_nodes
        self.cache = KVCache.allocate(a.n_layers, rows, a.n_kv_heads, length, a.head_dim, model.cache_dtype(),
                                      w.device)
        self.cached = [0] * rows  # [row] -> tokens of the committed sequence held in the cache
        self.device = w.device

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, self.cached[src])
        self.cached[dst] = self.cached[src]
        self.cached[src] = 0

    def reset_row(self, row: int) -> None:
        self.cached[row] = 0

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], shape: TreeShape) -> list[DraftTree]:
        B = len(contexts)
        trees = [DraftTree() for _ in range(B)]
        if B == 0 or shape.depth == 0:
            return trees
        logprobs = self._catch_up(contexts)  # [B, V]: after each root
        lengths = [len(c) for c in contexts]  # tree nodes go to cache positions length + node
        frontier: list[list[int]] = [[-1] for _ in range(B)]  # node ids whose children come next
        for d, width in enumerate(shape.widths):
            # logprobs rows: one per frontier node, sequence by sequence.
            top = logprobs.topk(width, dim=-1)
            vals, ids = top.values.tolist(), top.indices.tolist()
            new_frontier, row = [], 0
            for b in range(B):
                nodes = []
                for parent in frontier[b]:
                    base = 0.0 if parent < 0 else trees[b].scores[parent]
                    for lp, tok in zip(vals[row], ids[row]):
                        trees[b].tokens.append(tok)
                        trees[b].parents.append(parent)
                        trees[b].scores.append(base + lp)  # log path probability
                        nodes.append(len(trees[b].tokens) - 1)
                    row += 1
                new_frontier.append(nodes)
            frontier = new_frontier
            if shape.budget is not None:
                # A node outside the best `budget` so far stays out (its descendants score no
                # more and come later), so only those inside are expanded (EAGLE-2's
                # reranking): the same tree as expanding everything, in fewer, smaller passes.
                kept = [set(best_nodes(t, shape.budget)) for t in trees]
                frontier = [[n for n in nodes if n in keep] for nodes, keep in zip(frontier, kept)]
            if d + 1 == shape.depth or not any(frontier):
                break
            logprobs = self._expand(trees, frontier, lengths)
        for t in trees:
            t.scores = [math.exp(s) for s in t.scores]
        if shape.budget is not None:
            trees = [prune_best_first(t, shape.budget) for t in trees]
        return trees

    def _catch_up(self, contexts: list[list[int]]) -> torch.Tensor:
        """Feed each row the committed tokens its cache lacks (root included); return the
        draft's log-probabilities after the root [B, V]."""
        B = len(contexts)
        missing = [ctx[self.cached[b]:] for b, ctx in enumerate(contexts)]
        T = max(len(m) for m in missing)
        tokens = torch.zeros((B, T), dtype=torch.long)
        for b, m in enumerate(missing):
            tokens[b, : len(m)] = torch.tensor(m)
        start = torch.tensor(self.cached)[:B]
        n_new = torch.tensor([len(m) for m in missing])
        idx = torch.arange(T)
        block = (idx[None, :] <= idx[:, None])[None] & (idx[None, None, :] < n_new[:, None, None])
        block = block | torch.eye(T, dtype=torch.bool)
        key_len = int((start + T).max())
        h = self.model(tokens.to(self.device), (start[:, None] + idx).to(self.device),
                       attention_mask(block, start, key_len).to(self.device), self.cache, 0,
                       (start[:, None] + idx).to(self.device), key_len)
        last = h[torch.arange(B), (n_new - 1).to(self.device)]  # [B, D]
        for b, ctx in enumerate(contexts):
            self.cached[b] = len(ctx)
        return torch.log_softmax(self.model.logits(last), dim=-1)

    def _expand(self, trees: list[DraftTree], frontier: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """One draft forward over every frontier node; returns log-probs [sum of frontier sizes, V]."""
        B = len(trees)
        Tq = max(len(f) for f in frontier)
        Tk = max(len(t) for t in trees)  # tree nodes so far; node i sits at position length + i
        tokens = torch.zeros((B, Tq), dtype=torch.long)
        pos = torch.zeros((B, Tq), dtype=torch.long)
        write = torch.zeros((B, Tq), dtype=torch.long)
        block = torch.zeros((B, Tq, Tk), dtype=torch.bool)
        for b, (tree, nodes) in enumerate(zip(trees, frontier)):
            depths = tree.depths()
            for q, node in enumerate(nodes):
                tokens[b, q] = tree.tokens[node]
                pos[b, q] = lengths[b] - 1 + depths[node]  # root sits at length - 1
                write[b, q] = lengths[b] + node
                anc = node
                while anc >= 0:  # the node itself and its ancestors below the root
                    block[b, q, anc] = True
                    anc = tree.parents[anc]
            for q in range(len(nodes), Tq):  # pad rows: write past the tree, see themselves
                write[b, q] = lengths[b] + Tk + q
                pos[b, q] = lengths[b]
        # Pad rows need a visible key: give each its own (fresh) column.
        pad_cols = torch.zeros((B, Tq, Tq), dtype=torch.bool)
        for b, nodes in enumerate(frontier):
            for q in range(len(nodes), Tq):
                pad_cols[b, q, q] = True
        block = torch.cat([block, pad_cols], dim=2)
        start = torch.tensor(lengths)
        key_len = int(start.max()) + Tk + Tq
        h = self.model(tokens.to(self.device), pos.to(self.device),
                       attention_mask(block, start, key_len).to(self.device), self.cache, 0,
                       write.to(self.device), key_len)
        keep = torch.tensor([b * Tq + q for b, nodes in enumerate(frontier) for q in range(len(nodes))])
        rows = h.reshape(B * Tq, -1)[keep.to(self.device)]
        return torch.log_softmax(self.model.logits(rows), dim=-1)
