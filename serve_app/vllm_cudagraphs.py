"""CUDA graphs for every (batch size, k) a live policy may run (issue 49, item 3).

vLLM 0.32 decides at start which CUDA graphs to capture, from the speculative config it is
started with; adaspec changes k per step afterwards. What vLLM 0.32 does (read from its source,
checked by tests/test_vllm_cudagraphs.py with vLLM's own functions):

- Capture sizes (`VllmConfig._set_cudagraph_sizes`), when none are given: a token grid
  1, 2, 4, 8..248 by 8, 256.. by 16, up to min(2 x max_num_seqs x (1 + max_k), 512) tokens
  (1024 on data-centre Blackwell) and max_num_batched_tokens, plus n x (1 + k) for the k of
  each tier of the start table (`num_speculative_tokens_per_batch_size`). A step of more
  tokens than the largest size runs eager: at max_num_seqs 256 and max_k 8, batch 64 at
  chain8 (576 tokens) already does.
- Model Runner V1 (draft_model, mtp, ngram, custom_class on a GPU): with a per-batch-size k
  vLLM turns full graphs off and captures piecewise ones only
  (`VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`); they are keyed by token count,
  so any k is covered up to the largest size. The rounding of capture sizes to multiples of
  1 + max_k (`CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`) applies to V1 with
  full decode graphs only, so not here.
- Model Runner V2 (eagle, eagle3, ngram_gpu): full decode graphs are captured for the query
  lengths 1 + k of the k values in the START table only, each capture size rounded up to a
  multiple of that length (`CudaGraphManager._init_candidates`); the EAGLE drafter's
  multi-step drafting graphs likewise only for the start table's k (minus 0 and 1), and a
  step at another k drafts eagerly (`SpeculatorCudaGraphManager.capture`,
  `specialize_spec_tokens`). A k that the start policy does not use verifies with piecewise
  graphs and drafts eagerly, so it measures slower than it is, and the controller that tries
  it learns that.

So adaspec starts vLLM with:
1. `capture_table`: a start table holding every k of 0..max_k (batch 1 at max_k, batch 2 at
   max_k - 1, ...), so that V2 captures full graphs and drafting graphs for each k. The
   scheduler never runs it: AdaspecScheduler installs the configured start policy, which
   reaches it in START_POLICY_ENV (an environment variable rather than vLLM's
   `additional_config`, which is part of vLLM's compile-cache hash: every start policy would
   compile the model anew).
2. `capture_sizes` (GPU only; vLLM's CPU build captures no graphs and clears them): n x (1 + k)
   for every k of 0..max_k and every n of vLLM's own request-count grid (1, 2, 4, 8..248 by 8,
   256.. by 16, max_num_seqs: the rule vLLM applies to the start table's tiers), up to
   max_num_seqs x (1 + max_k), bounded by max_num_batched_tokens (vLLM drops larger sizes).
   Every batch size of the grid gets a full graph at every k on V2; a batch between two grid
   points runs the next larger graph, full where vLLM's dispatch finds one at that token
   count and piecewise otherwise (V2 tries the graphs of the smallest captured token count
   only; vLLM's own sizes leave the same gaps). No (batch, k) within max_num_batched_tokens
   runs eager. The price: more graphs to capture at start (the shipped GPU configs: 165
   sizes instead of 60), so a longer start and more graph memory; how much, only a GPU can
   tell.

With fewer batch sizes than k values (max_num_seqs < max_k + 1) the table holds only the
max_num_seqs largest k; the smaller ones then verify with piecewise graphs on V2.
"""

from __future__ import annotations

# The environment variable that carries the configured start policy (SpecPolicy text) from
# the app builder to AdaspecScheduler in vLLM's engine-core process (set in the replica's
# runtime_env; the engine core is a child process of the replica and inherits it).
START_POLICY_ENV = "ADASPEC_START_POLICY"


def request_counts(max_reqs: int) -> list[int]:
    """vLLM 0.32's grid of request counts to capture a decode graph for (the inner
    `request_counts` of vllm/config/vllm.py, `_set_cudagraph_sizes`), without its 512 cap:
    adaspec covers every batch size up to max_num_seqs."""
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += list(range(8, min(max_reqs + 1, 256), 8))
    counts += list(range(256, max_reqs + 1, 16))
    return sorted(set(counts + [max_reqs]))


def capture_table(max_num_seqs: int, max_k: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` that holds every k of 0..max_k:
    [[1, 1, max_k], [2, 2, max_k - 1], ..., [max_k, max_k, 1], [max_k + 1, max_num_seqs, 0]],
    cut at max_num_seqs. vLLM reads the set of k values from it to choose its graphs; the
    batch sizes they sit at do not matter, since AdaspecScheduler replaces the table."""
    rows = [[b, b, max_k + 1 - b] for b in range(1, min(max_k, max_num_seqs) + 1)]
    if max_num_seqs > max_k:
        rows.append([max_k + 1, max_num_seqs, 0])
    return rows


def capture_sizes(max_num_seqs: int, max_k: int, max_num_batched_tokens: int | None = None) -> list[int]:
    """compilation_config.cudagraph_capture_sizes: n x (1 + k) tokens for every k of 0..max_k
    and every n of request_counts(max_num_seqs); at most max_num_batched_tokens when given
    (vLLM drops the larger ones itself, with a warning, when it resolves its default)."""
    sizes = {n * (1 + k) for k in range(max_k + 1) for n in request_counts(max_num_seqs)}
    if max_num_batched_tokens is not None:
        sizes = {s for s in sizes if s <= max_num_batched_tokens}
    return sorted(sizes)
