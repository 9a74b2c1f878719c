"""Verify-pass step time against (batch size, tree size): the AdaTree characterization.

One target forward over B sequences x (1 root + N tree nodes) with ~`--context` tokens of
each sequence already in the KV cache, a tree attention mask, and logits for every node (as
a verify step needs), timed on random-weight models of real shapes. This is what decides the
best tree per batch size on a given machine: how much each extra node costs at each batch
size (little while a pass is memory-bound, its full compute once it is not).

    python -m bench.tree_step_time --models llama3-8b,llama3-1b --device cuda --dtype bfloat16 \\
        --out bench/results/tree-step-time-h200                 # a GPU machine, ~5 minutes
    python -m bench.tree_step_time --models smollm2-135m --device cpu --dtype float32 \\
        --batches 1,4,16 --nodes 0,1,3,7,15,31 --out bench/results/tree-step-time-cpu

Trees are balanced binary (breadth-first, two children per node); the time depends on the number
of tokens and the mask, not on which tokens. Prints one table per model (median ms per step,
and the cost relative to N = 0 at the same batch), writes result.json and step_time.png.
Random weights: no download, and the times are those of the real model of that shape.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from native_engine.kv_cache import KVCache  # noqa: E402
from native_engine.model import ModelArgs, Transformer  # noqa: E402
from native_engine.tree import attention_mask, tree_mask  # noqa: E402

# Hugging Face config numbers of the shapes (tied embeddings are untied: the lm_head matmul is
# the same either way, and untied weights initialise on the device without a host copy).
SHAPES = {
    "llama3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           intermediate_size=14336, rope_theta=500000.0, max_position=8192),
    "llama3-1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                           intermediate_size=8192, rope_theta=500000.0, max_position=8192),
    "smollm2-135m": ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                              intermediate_size=1536, rope_theta=100000.0, max_position=8192),
    "tiny": ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=128, max_position=2048),
}


def random_model(args: ModelArgs, dtype: torch.dtype, device: str, seed: int = 0) -> Transformer:
    """Random weights created on `device` directly (an 8B model never passes through the host)."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().prepare_for_serving()


def balanced_parents(nodes: int) -> list[int]:
    """A binary tree of `nodes` draft nodes, filled breadth-first: the root has two children,
    and so does every node (heap order with the root first; -1 = the root)."""
    return [i // 2 - 1 for i in range(nodes)]


def verify_inputs(batch: int, nodes: int, context: int, vocab: int, device: str):
    """tokens, RoPE positions, write positions [B, 1 + N] and the mask of one verify pass."""
    T = 1 + nodes
    parents = balanced_parents(nodes)
    depth = [0] * T
    for i, p in enumerate(parents):
        depth[i + 1] = depth[p + 1] + 1
    block = tree_mask(parents).expand(batch, T, T)
    lengths = torch.full((batch,), context)
    tokens = torch.randint(0, vocab, (batch, T))
    positions = context + torch.tensor(depth)[None].expand(batch, T)
    write = context + torch.arange(T)[None].expand(batch, T)
    mask = attention_mask(block, lengths, context + T)
    return [x.to(device) for x in (tokens, positions, write, mask)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def step_ms(model: Transformer, cache: KVCache, batch: int, nodes: int, context: int, device: str,
            repeats: int) -> float:
    """Median milliseconds of one verify pass (forward + logits of every node + argmax)."""
    tokens, positions, write, mask = verify_inputs(batch, nodes, context, model.args.vocab_size, device)

    def run():
        hidden = model(tokens, positions, mask, cache, 0, write, context + 1 + nodes)
        model.logits(hidden).argmax(-1)
        _sync(device)

    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def characterize(name: str, dtype: torch.dtype, device: str, batches: list[int], nodes: list[int], context: int,
                 repeats: int, max_tokens_per_step: int) -> list[dict]:
    args = SHAPES[name]
    print(f"[tree-step] {name}: building random weights ({args.num_params() / 1e9:.2f} B params, {dtype}, {device})",
          flush=True)
    model = random_model(args, dtype, device)
    cache = KVCache.allocate(args.n_layers, max(batches), args.n_kv_heads, context + 1 + max(nodes), args.head_dim,
                             dtype=dtype, device=device)
    rows = []
    for b in batches:
        for n in nodes:
            if b * (1 + n) > max_tokens_per_step:
                continue
            ms = step_ms(model, cache, b, n, context, device, repeats)
            rows.append({"model": name, "batch": b, "tree_nodes": n, "tokens": b * (1 + n), "step_ms": ms})
            print(f"[tree-step] {name} batch {b:3d} nodes {n:3d}: {ms:8.2f} ms", flush=True)
    del model, cache
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], name: str) -> str:
    """Markdown: median ms per (batch, tree nodes), and each as a multiple of that batch's N = 0."""
    mine = [r for r in rows if r["model"] == name]
    nodes = sorted({r["tree_nodes"] for r in mine})
    by = {(r["batch"], r["tree_nodes"]): r["step_ms"] for r in mine}
    lines = [f"{name}: verify step ms (x the same batch without draft nodes)",
             "| batch | " + " | ".join(f"N={n}" for n in nodes) + " |", "|---|" + "---|" * len(nodes)]
    for b in sorted({r["batch"] for r in mine}):
        base = by.get((b, 0))
        cells = []
        for n in nodes:
            ms = by.get((b, n))
            cells.append("-" if ms is None else f"{ms:.1f}" + (f" ({ms / base:.2f}x)" if base and n else ""))
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, title: str) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("[tree-step] matplotlib not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for b in sorted({r["batch"] for r in rows if r["model"] == name}):
            pts = sorted((r["tree_nodes"] + 1, r["step_ms"]) for r in rows if r["model"] == name and r["batch"] == b)
            ax.plot(*zip(*pts), marker="o", label=f"batch {b}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per sequence per verify pass (1 + tree nodes)")
        ax.set_ylabel("step ms")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "step_time.png"
    fig.savefig(path, dpi=120)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama3-8b,llama3-1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--nodes", default="0,1,3,7,15,31,63", help="draft nodes per sequence (0: no speculation)")
    parser.add_argument("--context", type=int, default=512, help="tokens already in each sequence's KV cache")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-tokens-per-step", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on cpu")
    parser.add_argument("--out", default=None, help="folder for result.json and step_time.png")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    batches, nodes = _ints(args.batches), _ints(args.nodes)
    if not batches or not nodes or min(batches) < 1 or min(nodes) < 0:
        parser.error("--batches needs sizes >= 1 and --nodes counts >= 0")
    hardware = torch.cuda.get_device_name() if args.device.startswith("cuda") else (platform.processor() or platform.machine())
    rows = []
    for name in models:
        rows += characterize(name, dtype, args.device, batches, nodes, args.context, args.repeats,
                             args.max_tokens_per_step)
    for name in models:
        print("\n" + table(rows, name))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"hardware": hardware, "device": args.device, "dtype": str(dtype).removeprefix("torch."),
                  "context": args.context, "repeats": args.repeats, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "command": " ".join(sys.argv[1:] if argv is None else argv),
                  "time": time.time(), "rows": rows}
        (out / "result.json").write_text(json.dumps(report, indent=2))
        png = plot(rows, out, f"verify step time, {hardware}, {report['dtype']}, context {args.context}")
        print(f"\n[tree-step] wrote {out / 'result.json'}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
