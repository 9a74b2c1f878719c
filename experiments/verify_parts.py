"""Ad hoc (2026-12-06; from the repository root: `PYTHONPATH=. .venv/bin/python experiments/verify_parts.py 16`, the batch size).
Where a decode step's time goes, by policy: the target pass (forward), the logits, acceptance
(greedy and sampled: the sampling distribution and rejection sampling), the rest of the step;
decode-only steps (no draft node) apart from verify steps (bench requests, bf16, eager)."""
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import native_engine.engine as E
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batch = int(sys.argv[1])
policies = sys.argv[2].split(",") if len(sys.argv) > 2 else ["off", "chain1", "chain2", "tree2x2x1x1"]
step_parts = defaultdict(float)  # parts of the step in progress


def timed(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        step_parts[label] += time.perf_counter() - t
        return r
    setattr(owner, name, w)


timed(E, "accept_greedy", "accept greedy")
timed(E, "accept_sampled", "accept sampled")
timed(E, "probs_from_logits", "probs")
timed(E.NativeEngine, "_draft", "draft")
timed(E.NativeEngine, "_commit", "commit")
timed(E.NativeEngine, "_verify", "verify all")

folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
timed(base.model, "forward", "forward")  # an instance attribute: nn.Module.__call__ finds it
timed(base.model, "logits", "logits")
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)

steps = []  # (policy, verified tokens per sequence, parts)
step = E.NativeEngine.step


def recorded(self):
    step_parts.clear()
    t = time.perf_counter()
    out = step(self)
    total = time.perf_counter() - t
    steps.append((self._policy_name, dict(step_parts), total, self._last_shape, self._new))
    return out


E.NativeEngine.step = recorded
verify = E.NativeEngine._verify


def verify_shape(self, decode, trees):
    self._last_shape = (len(decode), sum(len(t) for t in trees))
    return verify(self, decode, trees)


E.NativeEngine._verify = verify_shape
admit = E.NativeEngine._admit


def admit_count(self):
    new = admit(self)
    self._new = len(new)
    return new


E.NativeEngine._admit = admit_count
reqs = request_set(REQUESTS[batch], 0, 96, folder)
for rnd in range(2):
    for pol in policies:
        E.NativeEngine._policy_name = pol
        steps.clear()
        r = run(base, pol, reqs, batch)
        full = [(p, tot, sh) for _, p, tot, sh, new in steps if sh[0] == batch and not new]  # full, no prefill
        for label, pick in (("no nodes", lambda n: n == 0), ("nodes", lambda n: n > 0)):
            sel = [(p, tot, sh) for p, tot, sh in full if pick(sh[1])]
            if not sel:
                continue
            n = len(sel)
            mean = lambda k: 1000 * sum(p.get(k, 0.0) for p, _, _ in sel) / n
            fwd = mean("forward")
            print(f"b{batch} r{rnd} {pol:12s} {label:8s} {n:4d} steps, {sum(sh[1] for _, _, sh in sel) / n / batch:4.2f} nodes/seq: "
                  f"step {1000 * sum(t for _, t, _ in sel) / n:6.1f} ms = forward {fwd:5.1f} (all passes) + logits {mean('logits'):4.1f}"
                  f" + probs {mean('probs'):4.1f} + accept sampled {mean('accept sampled'):4.1f}"
                  f" + accept greedy {mean('accept greedy'):4.1f}; verify all {mean('verify all'):5.1f}, draft {mean('draft'):4.1f},"
                  f" commit {mean('commit'):4.1f}", flush=True)
        print(f"b{batch} r{rnd} {pol:12s} decode {r['decode_tokens_per_s']:6.1f} tok/s", flush=True)
