"""A chain verify step captured as a CUDA graph at several k, on the native engine's model and
torch alone (no vLLM): what vLLM does for every (batch size, k) adaspec's live policies may run
(serve_app/vllm_cudagraphs.py, docs/configuration.md "CUDA graphs"), checked and timed on the
GPU at hand.

For each batch size b and k: one target forward over b sequences x (1 + k) tokens, with
`--context` tokens of each sequence already in a static KV cache and logits for every token.
It is captured with torch.cuda.CUDAGraph on static inputs, replayed with other tokens, and
compared with the same pass run eagerly (its logits must agree), then both are timed. The
ratio eager / graph is what a (batch, k) without a captured graph would cost a GPU engine:
what the controller would measure for a k the engine was not started for.

    python -m bench.cuda_graph_step --model llama3-1b --batches 1,8,32,64 --ks 0,1,2,4,8 \\
        --out bench/results/cuda-graph-step-h100                 # about a minute on one H100

Prints a table (eager ms, graph ms, speed-up per (b, k)), writes result.json; exits 1 if a
capture failed or a replay disagreed with the eager pass, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from native_engine.attention import ForwardInputs, in_progress  # noqa: E402
from native_engine.kv_cache import KVCache  # noqa: E402
from native_engine.model import Transformer  # noqa: E402
from native_engine.tree import attention_mask, tree_mask  # noqa: E402


class VerifyStep:
    """One chain verify pass with every input in a tensor that stays put, so a CUDA graph
    captured from `run` replays it with whatever `tokens` holds then.

    `Transformer.forward` reads the largest position on the host (`int(positions.max())`, a
    device sync that a graph cannot hold); this runs what it runs after that read (the attention
    inputs of the pass set on `in_progress`, the decoder, the logits), with the RoPE tables and
    the mask prepared once. It attends with torch's attention (the decode-attention kernels are
    CPU-only), as the model does on a GPU."""

    def __init__(self, model: Transformer, batch: int, k: int, context: int, seed: int = 0):
        weight = model.lm_head.weight
        device, dtype = weight.device, weight.dtype
        args = model.args
        T = 1 + k
        self.model, self.key_len = model, context + T
        self.cache = KVCache.allocate(args.n_layers, batch, args.n_kv_heads, context + T, args.head_dim,
                                      dtype=model.cache_dtype(), device=device)
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, args.vocab_size, (batch, T), generator=gen).to(device)
        self.positions = (context + torch.arange(T))[None].expand(batch, T).to(device)
        cos_t, sin_t = model.rope(self.key_len)
        self.cos, self.sin = cos_t[self.positions].unsqueeze(2), sin_t[self.positions].unsqueeze(2)
        # A chain: the new tokens see the committed context and the tokens before them.
        block = tree_mask([i - 1 for i in range(k)]).expand(batch, T, T)
        allowed = attention_mask(block, torch.full((batch,), context), self.key_len).to(device)
        self.mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))

    def run(self) -> torch.Tensor:
        """Float32 logits [b, 1 + k, V] of the pass (its keys and values written to the cache)."""
        in_progress.inputs = ForwardInputs(self.mask, self.cache, 0, self.positions, self.key_len)
        try:
            return self.model.logits(self.model.decoder(self.tokens, self.cos, self.sin))
        finally:
            in_progress.inputs = None


@dataclass
class GraphRow:
    batch: int
    k: int
    tokens: int          # batch x (1 + k)
    eager_ms: float | None
    graph_ms: float | None
    max_abs_diff: float | None  # replayed logits against the eager pass's, on new tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def capture_and_time(model: Transformer, batch: int, k: int, context: int, repeats: int, tolerance: float) -> GraphRow:
    """Capture one (batch, k) verify step, replay it on new tokens against the eager pass, time both."""
    row = GraphRow(batch, k, batch * (1 + k), None, None, None)
    try:
        step = VerifyStep(model, batch, k, context)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch's docs ask before a capture
            for _ in range(3):
                step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step.run()
        step.tokens.copy_(torch.randint_like(step.tokens, model.args.vocab_size))  # the replay's new inputs
        graph.replay()
        replayed = captured.clone()
        eager = step.run()
        row.max_abs_diff = float((replayed - eager).abs().max())
        row.eager_ms = _median_ms(step.run, repeats)
        row.graph_ms = _median_ms(graph.replay, repeats)
        scale = float(eager.abs().max()) or 1.0
        if row.max_abs_diff > tolerance * scale:
            row.error = f"replay differs from the eager pass by {row.max_abs_diff:.3g} (logits up to {scale:.3g})"
        del graph, captured
    except RuntimeError as e:  # a capture that fails says why (an op that syncs, an allocation, ...)
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    torch.cuda.empty_cache()
    return row


def table(rows: list[GraphRow]) -> str:
    lines = ["| batch | k | tokens | eager ms | graph ms | eager / graph | max abs diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.ok:
            lines.append(f"| {r.batch} | {r.k} | {r.tokens} | {r.eager_ms:.2f} | {r.graph_ms:.2f} | "
                         f"{r.eager_ms / r.graph_ms:.2f}x | {r.max_abs_diff:.2g} |")
        else:
            lines.append(f"| {r.batch} | {r.k} | {r.tokens} | - | - | - | FAILED: {r.error} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from bench.tree_step_time import SHAPES, random_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-1b", help=f"one of {', '.join(SHAPES)} (random weights)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--ks", default="0,1,2,4,8", help="draft tokens per sequence (0: no speculation)")
    parser.add_argument("--context", type=int, default=512, help="tokens already in each sequence's KV cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="largest replay-vs-eager difference, as a fraction of the largest logit")
    parser.add_argument("--out", default=None, help="folder for result.json")
    args = parser.parse_args(argv)
    if args.model not in SHAPES:
        parser.error(f"--model: unknown {args.model}; choose from {', '.join(SHAPES)}")
    batches, ks = _ints(args.batches), _ints(args.ks)
    if not batches or not ks or min(batches) < 1 or min(ks) < 0:
        parser.error("--batches needs sizes >= 1 and --ks counts >= 0")
    if not torch.cuda.is_available():
        print("[cuda-graph-step] no CUDA device visible to torch: CUDA graphs need one", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name()
    print(f"[cuda-graph-step] {args.model} ({dtype}) on {device_name}: batches {batches}, k {ks}", flush=True)
    model = random_model(SHAPES[args.model], dtype, "cuda")
    rows = []
    for b in batches:
        for k in ks:
            rows.append(capture_and_time(model, b, k, args.context, args.repeats, args.tolerance))
            r = rows[-1]
            print(f"[cuda-graph-step] batch {b:3d} k {k}: " + (f"eager {r.eager_ms:.2f} ms, graph {r.graph_ms:.2f} ms"
                                                             if r.ok else f"FAILED {r.error}"), flush=True)
    print("\n" + table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"hardware": device_name, "model": args.model, "dtype": args.dtype, "context": args.context,
                  "repeats": args.repeats, "torch": torch.__version__, "time": time.time(),
                  "rows": [asdict(r) for r in rows]}
        (out / "result.json").write_text(json.dumps(report, indent=2))
        print(f"\n[cuda-graph-step] wrote {out / 'result.json'}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
