"""The native engine: continuous batching with token-tree speculation under a live policy.

One `step()` (how a serving loop drives it):
  schedule  -> reap aborted requests, admit waiting ones into free KV-cache rows
  policy    -> the running batch size picks the SpecConfig (a dense table, O(1))
  draft     -> the drafter proposes a token tree per decoding sequence; under per-request
               budgets (`auto`, `budgetN`) it offers a candidate tree per sequence and the
               batch's most likely nodes are kept, as many as pay (native_engine.budget)
  verify    -> one target pass over root + tree nodes of every decoding sequence, then
               greedy or exact stochastic acceptance (verify.py) per sequence
  commit    -> KV cache kept to the accepted path, tokens appended, finish checks
  prefill   -> one target pass over the newly admitted prompts, first token sampled
  release   -> finished rows freed, later rows moved down
  record    -> a StepRecord (adaspec.telemetry) for the controller

Drafts are always deterministic candidates (n-gram matches, a draft model's top-w), so
sampling uses the point-mass form of recursive rejection sampling (verify.accept_sampled).
Not thread-safe: a serving wrapper calls add_request / abort / step from one thread (or
under one lock).

Rows: running requests occupy KV-cache rows 0..B-1, decoding ones first, in admission
order; a finished request's row is refilled by moving later rows down, so every forward
reads a contiguous slice of the cache. A request's `cache_len` counts its committed tokens
in the cache; its last output token (the root) is not in the cache until it is verified.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from adaspec.engine_contract import EngineReport, PolicySlot
from adaspec.policy import PolicyAck, PolicyError, SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, RequestLifetimes, StepRecord
from native_engine import compiled_decode, cpu_kernels, machine_cache
from native_engine.attention import Packing, causal_mask
from native_engine.budget import BudgetPlan, BudgetPlanner
from native_engine.drafters import Drafter, NgramDrafter
from native_engine.kv_cache import KVCache
from native_engine.model import COMPILED_TOKENS_AT_BATCH_1, Transformer, load_model
from native_engine.requests import Request, RequestOutput, SamplingParams
from native_engine.stats import AcceptanceCounts
from native_engine.tree import DraftTree, TreeShape, attention_mask, batch_tree_inputs
from native_engine.verify import Acceptance, accept_greedy, accept_sampled, probs_from_logits, sample_index

# A verify pass runs packed (native_engine.attention.Packing) when its padded [B, T] layout holds at
# least this many pads. Packing adds a scatter and a gather to every layer, about 1.2 ms a pass
# on SmolLM2-135M (bf16, 2 Zen 4 cores), and saves about 0.3 ms a pad at batch 4 and at 16
# alike: side by side, packed minus unpacked, 1-3 pads +0.9 to +1.4 ms, 4 pads -1.5 to +0.4,
# 6 pads -1.3 to +0.7, 8 pads -1.0 to -2.2, 15-24 pads -4.6 to -9.5 (docs/native-engine.md,
# "Packing by pads"). The share of the layout used before (pack at <= 75% real) packed batch 4's
# small uneven trees at a loss and left batch 16's mostly-even ones unpacked.
PACK_MIN_PADS = 6
# calibrate_step_cost: draft nodes per sequence in each timed verify pass (a pattern repeated
# over the batch): every row alike, a few rows deep beside undrafted ones (padding), and
# mixed depths, so the step-cost fit sees tokens, padding and sequences vary apart. Each
# layout is timed CALIBRATION_REPEATS times after one warm-up pass, at each prompt length
# (tokens; the KV context attended).
CALIBRATION_LAYOUTS = ((0,), (1,), (2,), (4,), (1, 0), (2, 0), (4, 0, 0, 0), (8, 0, 0, 0), (0, 1, 2, 4))
CALIBRATION_REPEATS = 2
CALIBRATION_PROMPTS = (150, 500)
# load_or_calibrate_step_cost: the timed passes, per machine, model and engine layout, in
# $ADASPEC_CACHE_DIR/step-cost.json (native_engine/machine_cache.py).
STEP_COST_CACHE = "step-cost.json"


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16  # running requests (KV-cache rows)
    max_seq_len: int = 2048  # cache positions per row: prompt + output + one verify tree
    max_tree_nodes: int = 64  # draft nodes per sequence per step; bigger configs are refused
    tree_budget: int | None = None  # best-first node budget applied to every tree config
    # Per-request budgets: the candidate tree each sequence offers (widths per depth, expanded
    # best-first to max_tree_nodes); None = the drafter's own (`Drafter.budget_offer`).
    budget_offer: tuple[int, ...] | None = None
    max_prefill_tokens: int = 8192  # prompt tokens admitted per step (at least one request)
    seed: int = 0  # engine sampling generator (requests without their own seed)


class NativeEngine:
    """Continuous-batching speculative engine over a `Transformer` and a `Drafter`."""

    def __init__(self, model: Transformer, drafter: Drafter | None = None, config: EngineConfig = EngineConfig(),
                 policy: SpecPolicy | None = None, tokenizer=None, eos_token_ids: tuple[int, ...] = ()):
        self.model, self.drafter, self.config, self.tokenizer = model, drafter, config, tokenizer
        self.eos_ids = frozenset(eos_token_ids)
        a, w = model.args, model.lm_head.weight
        self.device = w.device
        self.cache = KVCache.allocate(a.n_layers, config.max_batch_size, a.n_kv_heads, config.max_seq_len,
                                      a.head_dim, model.cache_dtype(), w.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborted: list[Request] = []
        self._ids: set[str] = set()
        self._lifetimes = RequestLifetimes()
        self._generator = torch.Generator().manual_seed(config.seed)
        self.budget = BudgetPlanner()
        # The policy in force and the step buffer; raises PolicyError for a policy it cannot run.
        self.slot = PolicySlot(self.capabilities(), policy or SpecPolicy.uniform(SpecConfig.off()),
                               check=self._check_tree_room)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model: str, drafter: str | Drafter = "ngram", draft_model: str | None = None,
                        dtype: torch.dtype = torch.float32, device="cpu", config: EngineConfig = EngineConfig(),
                        policy: SpecPolicy | None = None) -> NativeEngine:
        """Load an embedded model name (see prepare.models) or an HF safetensors folder.

        drafter: "ngram", "draft_model" (with `draft_model` a name or folder), "none", or a
        Drafter instance."""
        from prepare.models import resolve_model
        from native_engine.drafters import DraftModelDrafter

        folder = Path(resolve_model(model, prepare=False))
        target = load_model(folder, dtype=dtype, device=device).prepare_for_serving()
        if drafter == "ngram":
            drafter = NgramDrafter()
        elif drafter == "draft_model":
            if draft_model is None:
                raise ValueError("drafter='draft_model' needs draft_model (a model name or folder)")
            small = load_model(resolve_model(draft_model, prepare=False), dtype=dtype,
                               device=device).prepare_for_serving()
            drafter = DraftModelDrafter(small, config.max_batch_size, config.max_seq_len)
        elif drafter == "none":
            drafter = None
        elif isinstance(drafter, str):
            raise ValueError(f"unknown drafter {drafter!r}: ngram, draft_model or none")
        tokenizer = None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return cls(target, drafter, config, policy, tokenizer, _eos_ids(folder))

    # ------------------------------------------------------------------ public surface
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams = SamplingParams()) -> None:
        """Queue a request; it joins the running batch at the next step with a free row."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs the engine's tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt).ids
        if not prompt:
            raise ValueError("prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        need = len(prompt) + params.max_tokens + self.config.max_tree_nodes + 1
        if need > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) + a verify tree "
                             f"({self.config.max_tree_nodes + 1}) exceed max_seq_len {self.config.max_seq_len}")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.waiting.append(Request(request_id, list(prompt), params, time.time(), generator=gen))
        self._ids.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its final output (finish_reason "abort") comes from the next step."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id and not req.finished:
                    req.finish_reason = "abort"
                    self._aborted.append(req)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def drain(self) -> EngineReport:
        """Steps and finished (not aborted) requests since the previous drain, and the load now."""
        return self.slot.drain(waiting=len(self.waiting), running=len(self.running))

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(engine="native", max_batch_size=self.config.max_batch_size,
                                  max_k=self.max_depth, supports_trees=True,
                                  supports_budgets=self.drafter is not None,
                                  draft_method=self.drafter.name if self.drafter else "none",
                                  max_tree_nodes=self.config.max_tree_nodes,
                                  accelerator=self.accelerator())

    def accelerator(self) -> str:
        """The device's name: the GPU's, or 'cpu'."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)

    def compile_decode(self, autotune: bool = False, cpp_wrapper: bool = True) -> float:
        """Compile the target's one-token passes and batch-1 verify passes
        (compiled_decode.compile_decode) and warm them up on cache rows 0 and 1 at positions 0-2
        (and, where the matmul path changes with the rows, on as many rows or positions as a
        graph of the wider passes needs), before any request runs (a prefill overwrites those
        entries). `autotune`, `cpp_wrapper`:
        see compiled_decode.compile_decode. Returns the seconds spent."""
        if self.has_unfinished():
            raise RuntimeError("compile_decode runs before the engine takes requests")

        def warm_up() -> None:
            # Where the matmul path changes with the rows (compiled_decode.compiled_row_splits),
            # the wider passes compile apart: one of each now, not mid-serving.
            splits = compiled_decode.compiled_row_splits(self.model)
            for rows in sorted({1, min(2, self.cache.rows)} | {r for r in splits if r <= self.cache.rows}):
                zeros = torch.zeros((rows, 1), dtype=torch.long, device=self.device)  # one token per row
                self.model(zeros, zeros, None, self.cache, 0, zeros, 1)
            # A verify pass at batch 1: the token count becomes symbolic.
            for tokens in sorted({2, 3} | {t for t in splits if t <= min(COMPILED_TOKENS_AT_BATCH_1, self.cache.max_len)}):
                ids = torch.zeros((1, tokens), dtype=torch.long, device=self.device)
                pos = torch.arange(tokens, device=self.device)[None]
                mask = causal_mask(torch.tensor([tokens], device=self.device), tokens)
                self.model(ids, pos, mask, self.cache, 0, pos, tokens)

        return compiled_decode.compile_decode(self.model, warm_up, autotune, cpp_wrapper)

    @torch.no_grad()  # as serving runs: a pass with grad would recompile the compiled graphs (compile_decode)
    def calibrate_step_cost(self, batch_sizes: tuple[int, ...] | None = None,
                            prompt_lengths: tuple[int, ...] = CALIBRATION_PROMPTS) -> float:
        """Time verify passes of set tree layouts (CALIBRATION_LAYOUTS) at each batch size and
        prompt length, and give them to the per-request budgets' step-cost fit as anchors
        (adaspec.step_cost.StepCost), before any request runs: without them the fit has
        only the steps the engine chose, and prices the budgets it did not run badly.
        The passes run over whatever the cache rows hold (no prompt is run) and change no
        request; nothing is recorded as a step. batch_sizes: default 1, 2, 4, ... and max_batch_size.
        Returns the seconds spent."""
        if self.has_unfinished():
            raise RuntimeError("calibrate_step_cost runs before the engine takes requests")
        start = time.perf_counter()
        rows = self.config.max_batch_size
        if batch_sizes is None:
            batch_sizes = tuple(sorted({min(2 ** i, rows) for i in range(rows.bit_length())} | {rows}))
        gen = torch.Generator().manual_seed(0)
        vocab = self.model.args.vocab_size
        room = self.config.max_seq_len - self.config.max_tree_nodes - 2  # a context, its root, one tree
        greedy = SamplingParams(max_tokens=1)
        for batch in batch_sizes:
            for length in sorted({min(n, room) for n in prompt_lengths}):
                # A pass costs the same whatever the cache holds: the rows are taken as they
                # are, no prompt is run through the model.
                decode = [Request(f"calibrate-{row}", [0] * length, greedy, 0.0, output=[0], row=row, cache_len=length)
                          for row in range(min(batch, rows))]
                context = sum(r.cache_len for r in decode)
                for repeat in range(1 + CALIBRATION_REPEATS):  # the first pass of a layout warms it up
                    for nodes in CALIBRATION_LAYOUTS:
                        trees = [_chain(min(nodes[j % len(nodes)], self.config.max_tree_nodes), gen, vocab)
                                 for j in range(len(decode))]
                        t0 = time.perf_counter()
                        _, verified, padded = self._verify(decode, trees)
                        if repeat:
                            self.budget.cost.add_anchor(time.perf_counter() - t0, len(decode), verified, padded,
                                                        context)
        return time.perf_counter() - start

    def load_or_calibrate_step_cost(self) -> tuple[float, bool]:
        """calibrate_step_cost at the default batch sizes and prompt lengths, once per machine,
        model and engine layout: the timed passes are cached (STEP_COST_CACHE), and a later
        engine with the same key - a replica restarted or replaced, another replica of the
        deployment on the same machine - takes them as its anchors instead of timing them
        again (20-80 s per replica start on 2 CPU cores). Returns (seconds, loaded from the cache).
        Delete the cache file to measure again (after a driver or BIOS change, say)."""
        start = time.perf_counter()
        key = self.step_cost_key()
        known = machine_cache.read_cached(STEP_COST_CACHE, key)
        if known is not None:
            for timed in known["passes"]:
                self.budget.cost.add_anchor(*timed)
            return time.perf_counter() - start, True
        seconds = self.calibrate_step_cost()
        machine_cache.write_cached(STEP_COST_CACHE, key, {"passes": self.budget.cost.anchor_passes})
        return seconds, False

    def step_cost_key(self) -> str:
        """What a verify pass's time depends on: the machine and the torch threads of the
        calling thread, the model's shape and dtype, the cache layout, the matmul and
        attention paths and the kernels' sources, whether the one-token pass is compiled, and
        the calibration itself."""
        model = self.model
        return "|".join([
            machine_cache.machine_key(), self.accelerator(), machine_cache.model_key(model.args, model.lm_head.weight.dtype),
            f"rows={self.config.max_batch_size},positions={self.config.max_seq_len},tree={self.config.max_tree_nodes}",
            f"matmuls={model.linear_choice and model.linear_choice.paths()},kernel={model.uses_decode_kernel()},compiled={model.compiled_decode is not None}",
            f"kernel_sources={cpu_kernels.sources_digest()}",
            f"layouts={CALIBRATION_LAYOUTS},repeats={CALIBRATION_REPEATS},prompts={CALIBRATION_PROMPTS}",
        ])

    @property
    def max_depth(self) -> int:
        return self.drafter.max_depth if self.drafter else 0

    # ------------------------------------------------------------------ policy
    def shape_for(self, config: SpecConfig) -> TreeShape:
        """What the drafter is asked for under `config` (per-request budgets: the offer)."""
        if config.per_request:
            return self.offer_shape
        return TreeShape.from_config(config, self.config.tree_budget)

    @property
    def offer_shape(self) -> TreeShape:
        """The candidate tree a sequence offers under per-request budgets."""
        if self.drafter is None:
            return TreeShape(())
        widths = self.config.budget_offer or self.drafter.budget_offer
        return TreeShape(tuple(widths[: self.drafter.max_depth]), budget=self.config.max_tree_nodes)

    @property
    def policy(self) -> SpecPolicy:
        """The policy in force."""
        return self.slot.policy

    def validate_policy(self, policy: SpecPolicy) -> None:
        """Raise PolicyError unless every config of `policy` can run on this engine."""
        self.slot.validate(policy)

    def apply_policy(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy` from the next step on; stale versions are ignored, bad ones rejected."""
        return self.slot.apply(policy)

    def _check_tree_room(self, policy: SpecPolicy) -> None:
        """Trees must fit the KV cache's spare room and the drafter's expansion limit."""
        for rule in policy.rules:
            shape = self.shape_for(rule.config)
            if shape.max_nodes > self.config.max_tree_nodes:
                raise PolicyError(f"{rule.config} verifies {shape.max_nodes} draft nodes per sequence; this engine's "
                                  f"KV cache leaves room for max_tree_nodes={self.config.max_tree_nodes}")
            if self.drafter is not None and shape.expanded_nodes > self.drafter.max_expanded_nodes:
                raise PolicyError(f"{rule.config} expands up to {shape.expanded_nodes} draft nodes; the "
                                  f"{self.drafter.name} drafter expands at most {self.drafter.max_expanded_nodes}")

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = self._reap_aborted()
        new = self._admit()
        if not self.running:
            return outputs
        config = self.slot.config_for(len(self.running))
        shape = self.shape_for(config)
        decode = self.running[: len(self.running) - len(new)]
        self._lifetimes.step([r.request_id for r in self.running], len(self.running), config)
        context = sum(r.cache_len for r in decode)
        plan: BudgetPlan | None = None
        drafting = not (config.per_request and decode) or self.budget.should_draft(len(decode), context)
        draft_start = time.perf_counter()
        trees = self._draft(decode, shape) if drafting else [DraftTree() for _ in decode]
        draft_s = time.perf_counter() - draft_start
        if config.per_request and decode:
            trees, plan = self.budget.plan(decode, trees, config.max_nodes, context)
        results, verified, padded = self._verify(decode, trees)
        outputs += self._commit(decode, results)
        if plan is not None:  # after the commit: the offers are learned from the outputs
            self.budget.observe(decode, trees, results, plan)
            if drafting:
                self.budget.record_draft(len(decode), draft_s, plan)
            else:
                self.budget.undrafted_steps += 1
        outputs += self._prefill(new)
        self._release_finished()
        counts = AcceptanceCounts(shape.widths if decode else (), per_rank=plan is None)
        for tree, result in zip(trees, results):
            counts.add(tree, result)
        duration = time.perf_counter() - start
        if decode and not new:  # a pure decode step: what the budget's cost fit models
            self.budget.record_step(duration, len(decode), verified, padded, context)
        self._record(duration, config, decode, new, verified, context, counts, plan)
        return outputs

    def _reap_aborted(self) -> list[RequestOutput]:
        outs = []
        for req in self._aborted:
            if req in self.waiting:
                self.waiting.remove(req)
            self._ids.discard(req.request_id)
            self._lifetimes.discard(req.request_id)
            outs.append(RequestOutput(req.request_id, [], True, "abort", len(req.prompt), len(req.output), req.text))
        self._aborted.clear()
        self._release_finished()
        return outs

    def _admit(self) -> list[Request]:
        new, tokens = [], 0
        while self.waiting and len(self.running) < self.config.max_batch_size:
            req = self.waiting[0]
            if new and tokens + len(req.prompt) > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            req.row = len(self.running)
            if self.drafter is not None:
                self.drafter.reset_row(req.row)
            self.running.append(req)
            new.append(req)
            tokens += len(req.prompt)
        return new

    def _draft(self, decode: list[Request], shape: TreeShape) -> list[DraftTree]:
        if not decode or shape.depth == 0 or self.drafter is None:
            return [DraftTree() for _ in decode]
        return self.drafter.propose([r.context for r in decode], shape)

    def _verify(self, decode: list[Request], trees: list[DraftTree]) -> tuple[list[Acceptance], int, int]:
        """One target pass over root + nodes of every decoding sequence; accept per sequence.
        Returns the acceptances, the tokens verified and the tokens of the padded layout
        (sequences x the longest tree + 1: what attention runs over)."""
        if not decode:
            return [], 0, 0
        lengths = [r.cache_len for r in decode]
        tokens, pos, write, block = batch_tree_inputs(trees, [r.output[-1] for r in decode], lengths)
        T = tokens.shape[1]
        key_len = max(lengths) + T
        assert key_len <= self.cache.max_len, "cache row overflow: admission should have prevented it"
        dev = self.device
        counts = [len(t) + 1 for t in trees]
        if T == 1 and min(lengths) == max(lengths):
            mask = None  # one token per row, every row as long: each attends all key_len keys
        else:
            mask = attention_mask(block, torch.tensor(lengths), key_len, counts).to(dev)
        real = torch.tensor([b * T + i for b, n in enumerate(counts) for i in range(n)], device=dev)
        # Uneven trees: skip the pads' matmul work.
        packed = Packing(real, len(trees), T) if len(trees) * T - len(real) >= PACK_MIN_PADS else None
        hidden = self.model(tokens.to(dev), pos.to(dev), mask, self.cache, 0, write.to(dev), key_len, packed)
        hidden = hidden[0] if packed is not None else hidden.reshape(-1, hidden.shape[-1])[real]
        logits = self.model.logits(hidden)  # [sum counts, V]
        argmax = logits.argmax(-1).tolist()
        results, offset = [], 0
        for req, tree, n in zip(decode, trees, counts):
            rows = slice(offset, offset + n)
            offset += n
            children = tree.children()
            if req.params.greedy:
                results.append(accept_greedy(children, tree.tokens, argmax[rows]))
            else:
                probs = probs_from_logits(logits[rows], req.params.temperature, req.params.top_p).cpu()
                results.append(accept_sampled(children, tree.tokens, probs, req.generator or self._generator))
        return results, sum(counts), len(trees) * T

    def _commit(self, decode: list[Request], results: list[Acceptance]) -> list[RequestOutput]:
        """Keep each sequence's accepted path in the cache and append its gained tokens."""
        outs = []
        for req, result in zip(decode, results):
            self.cache.keep_path(req.row, req.cache_len, result.path)
            req.cache_len += len(result.path)
            outs.append(self._emit(req, req.append(result.tokens, self.eos_ids, self._decode_fn(req))))
        return outs

    def _prefill(self, new: list[Request]) -> list[RequestOutput]:
        """One target pass over the new prompts, one after another; sample each first token."""
        if not new:
            return []
        lengths = [len(r.prompt) for r in new]
        dev = self.device
        tokens = torch.tensor([t for r in new for t in r.prompt], device=dev)[None]  # [1, N]
        pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)[None]
        hidden = self.model(tokens, pos, None, self.cache, new[0].row, prompt_lengths=tuple(lengths))
        last = hidden[0, (torch.tensor(lengths).cumsum(0) - 1).to(dev)]  # each prompt's last token
        logits = self.model.logits(last)  # [P, V]
        argmax = logits.argmax(-1).tolist()
        outs = []
        for b, req in enumerate(new):
            req.cache_len = len(req.prompt)
            if req.params.greedy:
                tok = argmax[b]
            else:
                probs = probs_from_logits(logits[b], req.params.temperature, req.params.top_p)
                tok = sample_index(probs, req.generator or self._generator)
            outs.append(self._emit(req, req.append([tok], self.eos_ids, self._decode_fn(req))))
        return outs

    def _release_finished(self) -> None:
        """Drop finished requests and move later rows down so rows stay 0..B-1."""
        alive = [r for r in self.running if not r.finished]
        for req in self.running:
            if req.finished:
                self._ids.discard(req.request_id)
                self._close_lifetime(req)
        for i, req in enumerate(alive):
            if req.row != i:
                self.cache.move_row(req.row, i, req.cache_len)
                if self.drafter is not None:
                    self.drafter.move_row(req.row, i)
                req.row = i
        self.running = alive

    def _record(self, duration_s: float, config: SpecConfig, decode: list[Request], new: list[Request],
                verified: int, context: int, counts: AcceptanceCounts, plan: BudgetPlan | None) -> None:
        prefill_tokens = sum(len(r.prompt) for r in new)
        self.slot.record_step(StepRecord(
            time=time.time(), duration_s=duration_s, batch_size=len(decode) + len(new),
            num_decode_reqs=len(decode), scheduled_tokens=verified + prefill_tokens,
            prefill_tokens=prefill_tokens, context_tokens=context, config=config,
            policy_version=self.policy.version, num_drafts=counts.num_drafts,
            draft_k=config.depth if decode and self.drafter is not None else 0,
            drafted_per_pos=counts.drafted_per_pos, accepted_per_pos=counts.accepted_per_pos,
            reached_per_depth_rank=counts.reached, accepted_per_depth_rank=counts.accepted,
            nodes_per_seq=counts.nodes_per_seq, accepted_per_seq=counts.accepted_per_seq,
            node_budget=plan.budget if plan is not None else None,
        ))

    # ------------------------------------------------------------------ helpers
    def _close_lifetime(self, req: Request) -> None:
        if req.finish_reason == "abort":
            self._lifetimes.discard(req.request_id)
            return
        record = self._lifetimes.finish(req.request_id, req.arrival, len(req.prompt), len(req.output))
        if record is not None:
            self.slot.record_request(record)

    def _decode_fn(self, req: Request):
        if self.tokenizer is None:
            return None
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, req: Request, tokens: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, tokens, req.finished, req.finish_reason, len(req.prompt),
                             len(req.output), req.text)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Run `prompts` to completion (a convenience for scripts and tests); output token ids."""
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]


def _chain(nodes: int, gen: torch.Generator, vocab: int) -> DraftTree:
    """A chain of `nodes` random tokens (a layout to time, not a draft)."""
    return DraftTree(tokens=torch.randint(0, vocab, (nodes,), generator=gen).tolist(),
                     parents=list(range(-1, nodes - 1)), scores=[0.5] * nodes)


def _eos_ids(folder: Path) -> tuple[int, ...]:
    """EOS token ids from generation_config.json, else config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()
