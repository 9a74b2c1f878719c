"""Speculation configs and policies: what the controller sends down to a replica.

Terms
- `SpecConfig`: how much to speculate in one engine step. A token tree written as its
  widths per depth: `()` is no speculation (`off`), `(1, 1, 1, 1)` is a chain of k=4 draft
  tokens (`chain4`), `(4, 2, 2, 1)` a tree whose root has 4 children, each of those 2, ...
  (`tree4x2x2x1`). A chain is a tree of width 1.
  Per-request budgets (engines that run them: the native engine): `auto` lets the engine
  decide at every step how many draft nodes each running sequence gets, keeping the nodes
  most likely to be accepted across the whole batch, as many as pay for their verify cost;
  `budget16` does the same with at most 16 nodes per step in all.
- `SpecPolicy`: a versioned table batch-size range -> SpecConfig covering every batch size
  the engine can run. A replica looks the running batch size up in it at every step.

The text syntax (CLI and config files): `1-2:chain4,3-8:chain2,9+:off`; `lo-hi` is an
inclusive range, `lo+` is open-ended. The table is compiled once into a dense list indexed
by batch size (as vLLM does for `num_speculative_tokens_per_batch_size`) so the hot path
is one list lookup; `SpecPolicy.from_table` is the way back.

In Python a config is a value (`SpecConfig`, compared with ==, hashable); on the wire (JSON:
telemetry, policies, checkpoints) it is its text, `chain4`, which is how every reader and
log line names it and costs a cached lookup to read back.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# An open-ended range ends here; larger than any engine's max_num_seqs.
OPEN_END = 1 << 20

_CONFIG_RE = re.compile(r"^(off|chain(\d+)|tree(\d+(?:x\d+)*)|budget(\d+)|auto)$")


class PolicyError(ValueError):
    """A speculation config or policy that is malformed or that the engine cannot run."""


class SpecConfig(BaseModel):
    """How much to speculate in one step: token-tree widths per depth (empty = off), or
    per-request budgets (`auto`, `budgetN`), where the engine sizes each sequence's tree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    widths: tuple[Annotated[int, Field(ge=1)], ...] = Field(
        default=(), description="children per node at each depth; () = off, all 1 = chain"
    )
    per_request: bool = Field(default=False, description="the engine chooses each sequence's draft nodes per step")
    max_nodes: int | None = Field(default=None, ge=1,
                                  description="per-request budgets: most draft nodes per step, whole batch")

    # The controller and the simulator compare and look up configs millions of times a
    # minute; pydantic's generic __eq__ (every field, private and extra state) costs ~10x
    # comparing the three fields. Equal configs hash alike, as frozen models must.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpecConfig):
            return NotImplemented
        return self is other or (self.widths == other.widths and self.per_request == other.per_request
                                 and self.max_nodes == other.max_nodes)

    def __hash__(self) -> int:
        return hash((self.widths, self.per_request, self.max_nodes))

    @model_validator(mode="after")
    def _one_kind(self) -> SpecConfig:
        if self.per_request and self.widths:
            raise ValueError("a per-request budget has no fixed widths")
        if self.max_nodes is not None and not self.per_request:
            raise ValueError("max_nodes belongs to a per-request budget (per_request=True)")
        return self

    @classmethod
    def off(cls) -> SpecConfig:
        return _shared_config(())

    @classmethod
    def chain(cls, k: int) -> SpecConfig:
        if k < 0:
            raise PolicyError(f"chain length must be >= 0, got {k}")
        return _shared_config((1,) * k)

    @classmethod
    def tree(cls, widths: tuple[int, ...] | list[int]) -> SpecConfig:
        return _shared_config(tuple(widths))

    @classmethod
    def budget(cls, max_nodes: int | None = None) -> SpecConfig:
        """Per-request budgets: `auto` (None) or `budgetN` (at most N nodes per step)."""
        if max_nodes is not None and max_nodes < 1:
            raise PolicyError(f"a node budget must be >= 1, got {max_nodes}")
        return _shared_config((), True, max_nodes)

    @model_validator(mode="wrap")
    @classmethod
    def _from_text(cls, value, handler):
        if isinstance(value, str):
            return _parse_config(value)
        return handler(value)

    @model_serializer(mode="plain")
    def _as_text(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """Parse `off`, `chainK` or `treeW1xW2x...` (case-insensitive)."""
        return _parse_config(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> SpecConfig:
        m = _CONFIG_RE.match(text.strip().lower())
        if m is None:
            raise PolicyError(f"bad speculation config {text!r}: expected off, chainK, treeAxBx..., budgetN or auto")
        if m.group(2) is not None:
            return cls.chain(int(m.group(2)))
        if m.group(3) is not None:
            widths = tuple(int(w) for w in m.group(3).split("x"))
            if any(w < 1 for w in widths):
                raise PolicyError(f"bad tree {text!r}: every width must be >= 1")
            return cls.tree(widths)
        if m.group(4) is not None:
            return cls.budget(int(m.group(4)))
        if m.group(1) == "auto":
            return cls.budget()
        return cls.off()

    @property
    def depth(self) -> int:
        """Draft tokens along the longest path (= draft passes); k for a chain; 0 for a
        per-request budget (its depth varies per sequence and step)."""
        return len(self.widths)

    @property
    def is_off(self) -> bool:
        return not self.widths and not self.per_request

    @property
    def is_chain(self) -> bool:
        return not self.per_request and all(w == 1 for w in self.widths)

    @property
    def num_nodes(self) -> int:
        """Draft tokens verified per sequence (tree nodes, root excluded); 0 for a
        per-request budget (they vary per sequence and step)."""
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def __str__(self) -> str:
        if self.per_request:
            return "auto" if self.max_nodes is None else f"budget{self.max_nodes}"
        return _config_text(self.widths)


@functools.lru_cache(maxsize=4096)
def _parse_config(text: str) -> SpecConfig:
    # Configs are frozen, so every reader of "chain4" can share one instance.
    return SpecConfig._parse_uncached(text)


@functools.lru_cache(maxsize=4096)
def _shared_config(widths: tuple[int, ...], per_request: bool = False, max_nodes: int | None = None) -> SpecConfig:
    # As _parse_config: every maker of chain(4) shares one (validated) instance.
    return SpecConfig(widths=widths, per_request=per_request, max_nodes=max_nodes)


@functools.lru_cache(maxsize=4096)
def _config_text(widths: tuple[int, ...]) -> str:
    if not widths:
        return "off"
    if all(w == 1 for w in widths):
        return f"chain{len(widths)}"
    return "tree" + "x".join(str(w) for w in widths)


class PolicyRule(BaseModel):
    """Batch sizes batch_lo..batch_hi (inclusive, requests) run `config`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_lo: int = Field(ge=1)
    batch_hi: int = Field(ge=1)
    config: SpecConfig

    @model_validator(mode="after")
    def _ordered(self) -> PolicyRule:
        if self.batch_hi < self.batch_lo:
            raise ValueError(f"batch range {self.batch_lo}-{self.batch_hi} is empty")
        return self


@functools.lru_cache(maxsize=4096)
def _shared_rule(batch_lo: int, batch_hi: int, config: SpecConfig) -> PolicyRule:
    # As _shared_config: rules are frozen, and a controller builds the same few for every
    # replica every period.
    return PolicyRule(batch_lo=batch_lo, batch_hi=batch_hi, config=config)


class SpecPolicy(BaseModel):
    """A versioned table batch-size range -> SpecConfig, built by the controller or a user.

    Rules are sorted, contiguous, start at batch size 1, and do not overlap; whether they
    reach the engine's largest batch is checked against the engine (`check_engine`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=0, description="monotone; a replica ignores versions older than its own")
    replica_id: str | None = Field(default=None, description="the replica it was built for; None = any")
    rules: tuple[PolicyRule, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _contiguous(self) -> SpecPolicy:
        expected_lo = 1
        for rule in self.rules:
            if rule.batch_lo != expected_lo:
                raise ValueError(
                    f"rules must be contiguous from batch size 1: expected a rule starting at "
                    f"{expected_lo}, got {rule.batch_lo}-{rule.batch_hi}"
                )
            expected_lo = rule.batch_hi + 1
        return self

    @classmethod
    def uniform(cls, config: SpecConfig, version: int = 0, replica_id: str | None = None) -> SpecPolicy:
        return cls(version=version, replica_id=replica_id,
                   rules=(PolicyRule(batch_lo=1, batch_hi=OPEN_END, config=config),))

    @classmethod
    def parse(cls, table: str, version: int = 0, replica_id: str | None = None) -> SpecPolicy:
        """Parse `1-2:chain4,3-8:chain2,9+:off`; a bare config (`chain4`) covers all sizes."""
        table = table.strip()
        if ":" not in table:
            return cls.uniform(SpecConfig.parse(table), version=version, replica_id=replica_id)
        rules = []
        try:
            for part in table.split(","):
                rng, sep, cfg = part.strip().partition(":")
                m = re.fullmatch(r"(\d+)(?:-(\d+)|(\+))", rng.strip())
                if not sep or m is None:
                    raise PolicyError(f"bad policy entry {part.strip()!r}: expected LO-HI:CONFIG or LO+:CONFIG")
                lo = int(m.group(1))
                hi = OPEN_END if m.group(3) else int(m.group(2))
                rules.append(PolicyRule(batch_lo=lo, batch_hi=hi, config=SpecConfig.parse(cfg)))
            return cls(version=version, replica_id=replica_id, rules=tuple(rules))
        except PolicyError:
            raise
        except ValueError as e:  # pydantic's ValidationError
            raise PolicyError(f"bad policy {table!r}: {e}") from None

    def config_for(self, batch_size: int) -> SpecConfig:
        for rule in self.rules:
            if rule.batch_lo <= batch_size <= rule.batch_hi:
                return rule.config
        return self.rules[-1].config

    @property
    def max_depth(self) -> int:
        return max(rule.config.depth for rule in self.rules)

    def check_engine(self, max_batch_size: int, max_k: int, supports_trees: bool,
                     supports_budgets: bool = False) -> None:
        """Raise PolicyError unless an engine with these capabilities can run this policy."""
        if self.rules[-1].batch_hi < max_batch_size:
            raise PolicyError(
                f"policy covers batch sizes up to {self.rules[-1].batch_hi}, "
                f"but the engine runs up to {max_batch_size}"
            )
        for rule in self.rules:
            cfg = rule.config
            if cfg.per_request:
                if not supports_budgets:
                    raise PolicyError(f"{cfg} is a per-request budget; this engine runs fixed chains or trees "
                                      "only (per-request budgets need engine: native)")
                continue
            if not supports_trees and not cfg.is_chain:
                raise PolicyError(f"{cfg} is a tree; this engine runs chains only")
            if cfg.depth > max_k:
                raise PolicyError(f"{cfg} drafts {cfg.depth} tokens; this engine was started with k <= {max_k}")

    def compile(self, max_batch_size: int) -> list[SpecConfig]:
        """Dense lookup: result[b] is the config for batch size b (index 0 unused)."""
        table = [self.rules[0].config] * (max_batch_size + 1)
        for rule in self.rules:
            for b in range(rule.batch_lo, min(rule.batch_hi, max_batch_size) + 1):
                table[b] = rule.config
        return table

    @classmethod
    def from_table(cls, table: Sequence[SpecConfig], version: int = 0, replica_id: str | None = None) -> SpecPolicy:
        """The inverse of `compile`: table[b] is the config for batch size b (index 0 unused);
        equal neighbours merge into one rule, and the last rule is open-ended."""
        if len(table) < 2:
            raise PolicyError("a dense table needs at least batch size 1")
        rules: list[list] = []  # [lo, hi, config]
        for b in range(1, len(table)):
            if rules and (rules[-1][2] is table[b] or rules[-1][2] == table[b]):
                rules[-1][1] = b
            else:
                rules.append([b, b, table[b]])
        rules[-1][1] = OPEN_END
        return cls(version=version, replica_id=replica_id,
                   rules=tuple(_shared_rule(lo, hi, c) for lo, hi, c in rules))

    def with_configs(self, batch_lo: int, batch_hi: int, config: SpecConfig) -> SpecPolicy:
        """This policy with batch sizes batch_lo..batch_hi running `config` (same version)."""
        table = self.compile(max(batch_hi, self.rules[-1].batch_lo) + 1)
        table[batch_lo: batch_hi + 1] = [config] * (batch_hi - batch_lo + 1)
        return SpecPolicy.from_table(table, version=self.version, replica_id=self.replica_id)

    def same_rules(self, other: SpecPolicy | None) -> bool:
        """Whether `other` runs the same config at every batch size (versions aside)."""
        return other is not None and self.rules == other.rules

    def to_vllm_table(self, max_batch_size: int) -> list[list[int]]:
        """vLLM's `num_speculative_tokens_per_batch_size`: [[lo, hi, k], ...] (chains only)."""
        return [
            [r.batch_lo, min(r.batch_hi, max_batch_size), r.config.depth]
            for r in self.rules
            if r.batch_lo <= max_batch_size
        ]

    def __str__(self) -> str:
        parts = []
        for r in self.rules:
            rng = f"{r.batch_lo}+" if r.batch_hi >= OPEN_END else f"{r.batch_lo}-{r.batch_hi}"
            parts.append(f"{rng}:{r.config}")
        return ",".join(parts)


class PolicyAck(BaseModel):
    """A replica's answer to a policy push."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str = ""
    status: str  # applied | ignored_stale | rejected | not_this_replica
    version_in_force: int
    policy_in_force: str
    message: str = ""


def full_tree_parents(widths: tuple[int, ...]) -> list[int]:
    """Parents array of the full tree with `widths` children per node at each depth (BFS order)."""
    parents: list[int] = []
    frontier = [-1]
    for w in widths:
        nxt = []
        for p in frontier:
            for _ in range(w):
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents
