"""`adaspec sweep`: every policy at every rate against one running deployment.

    adaspec sweep --config configs/app.yaml --policies off,chain1,chain2,chain3,chain4,table:profiled,adaptive \\
        --rates 0.5,inf --dataset sharegpt,codeedit --num-prompts 32 --rounds 3 --max-tokens 64 --out DIR

1. The deployment starts once (`serve run` on a copy of CONFIG, saved as DIR/app-config.yaml:
   speculation.max_k raised to the deepest chain asked for, the controller enabled and, with
   --profile, seeded with the same profile table:profiled is built from; a fresh controller
   checkpoint folder, so no earlier run's models leak in).
2. Round after round; in each, for each rate and dataset, each policy in an interleaved
   order (bench/policies.py): static policies are pushed through POST /admin/policy with the
   controller paused; `adaptive` resets the replicas to the config's start policy, resumes
   the controller and sends its load once every replica runs the controller's policy. In a
   round every policy sees the same prompts, arrival times and sampling (realistic by
   default, bench/client.RequestMix); each round draws new ones.
3. Optionally the phase-change trace (bench/phase.py) and the cross-check against vLLM's
   own benchmark client (bench/cross_check.py), on the same engine.
4. DIR/results.json after every run (a partial sweep is still readable), then
   bench/report.py writes report.md and the plots.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from serve_app import admin_client
from bench import machine
from testkit.serve_process import ServeProcess
from bench.client import RequestMix, RequestResult, arrival_times
from bench.metrics import tpot_s
from prepare.datasets import load_prompts
from bench.harness import BenchResult, BenchSettings, bench_prompts, served_model
from bench.phase import run_phase_change
from bench.cross_check import cross_check
from bench.policies import NamedPolicy, apply_policy, interleaved


class SweepSettings(BaseModel):
    config: str
    policies: list[str]
    rates: list[float]
    datasets: list[str]
    num_prompts: int
    rounds: int = Field(default=1, ge=1, description="interleaved rounds of every cell (new prompts each round)")
    max_tokens: int = 64
    request_mix: RequestMix = Field(default_factory=RequestMix)
    seed: int = 0
    burstiness: float = 1.0
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    profile: str | None = None
    phase_trace: str | None = Field(default=None, description="DATASET:RATE:SECONDS,... (bench/phase.py)")
    cross_check_rate: float | None = Field(default=None, description="rate of the vLLM-client cross-check")
    out: str


class SweepRun(BaseModel):
    dataset: str
    rate: float
    policy: str
    table: str | None
    order: int = Field(description="position in the sweep (0 = first run)")
    round: int = 0
    tpots_s: list[float] = Field(default_factory=list, description="TPOT of each request with 2+ tokens (seconds)")
    result: BenchResult


def prepare_config(config: Path, out: Path, max_k: int, profile: str | None) -> tuple[Path, str, str, list[str]]:
    """Write the sweep's copy of the Serve config; return it, the URL, the start policy and
    notes on what changed."""
    doc = yaml.safe_load(config.read_text())
    app = doc["applications"][0]
    args = app.setdefault("args", {})
    spec = args.setdefault("speculation", {})
    ctrl = args.setdefault("controller", {})
    notes = []
    if max_k > spec.get("max_k", 4):
        notes.append(f"speculation.max_k raised from {spec.get('max_k', 4)} to {max_k} for the deepest chain asked for")
        spec["max_k"] = max_k
    if not ctrl.get("enabled"):
        notes.append("controller.enabled set to true (paused except for `adaptive`)")
        ctrl["enabled"] = True
    if profile and not ctrl.get("profile_path"):
        notes.append(f"controller.profile_path set to {profile} (the profile table:profiled is built from)")
        ctrl["profile_path"] = str(Path(profile).resolve())
    args.setdefault("admin", {})["enabled"] = True
    http = doc.get("http_options", {})
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
    path = out / "app-config.yaml"
    path.write_text(f"# written by adaspec sweep from {config}\n" + yaml.safe_dump(doc, sort_keys=False))
    return path, url, str(spec.get("policy", "chain4")), notes


class Sweep:
    """One deployment, many runs; results.json is rewritten after every run."""

    def __init__(self, settings: SweepSettings, policies: list[NamedPolicy], command: list[str], log=None):
        self.s, self.policies = settings, policies
        self.log = log or (lambda msg: print(msg, flush=True))
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.doc: dict = {"command": " ".join(shlex.quote(a) for a in command), "settings": settings.model_dump(),
                          "policies": {p.name: p.table for p in policies}, "machine": machine.describe(),
                          "runs": [], "phase_change": None, "cross_check": None, "notes": []}
        self.url = ""
        self.model = ""
        self.start_table = ""

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.out / "results.json")

    def bench(self, dataset: str, rate: float, policy: NamedPolicy, round_index: int = 0,
              request_mix: RequestMix | None = None) -> tuple[BenchResult, list[float]]:
        """One cell of one round: (its result, the TPOT of each request). Round r draws its
        prompts, arrival times and sampling with seed + r: every policy of a round sees the same.
        `request_mix`: the sweep's unless given."""
        seed = self.s.seed + round_index
        settings = BenchSettings(url=self.url, dataset=dataset, rate=rate, num_prompts=self.s.num_prompts,
                                 burstiness=self.s.burstiness, max_tokens=self.s.max_tokens, seed=seed,
                                 request_mix=request_mix or self.s.request_mix, slo_ttft_s=self.s.slo_ttft_s,
                                 slo_tpot_s=self.s.slo_tpot_s, label=policy.name)
        prompts = load_prompts(dataset, self.s.num_prompts, seed, split="test")
        offsets = arrival_times(rate, len(prompts), seed, self.s.burstiness)
        apply_policy(self.url, policy, self.start_table)
        result = asyncio.run(bench_prompts(settings, prompts, offsets, self.model, progress=sys.stderr.isatty()))
        tpots = [t for r in result.requests if not r["error"] and (t := tpot_s(RequestResult(**r))) is not None]
        result.requests = []  # per-request rows stay out of the committed file
        if not policy.adaptive:
            result.telemetry.timeline = []
        return result, tpots

    def warm_up(self) -> None:
        """A few requests per dataset under the deepest static policy: compile paths, caches."""
        deepest = max((p for p in self.policies if not p.adaptive), key=lambda p: p.max_depth, default=None)
        for dataset in self.s.datasets:
            for policy in [p for p in self.policies if not p.adaptive and p.max_depth == 0][:1] + [deepest]:
                if policy is None:
                    continue
                prompts = load_prompts(dataset, 4, self.s.seed + 1, split="test")
                apply_policy(self.url, policy, self.start_table)
                settings = BenchSettings(url=self.url, dataset=dataset, rate=float("inf"), num_prompts=4,
                                         max_tokens=16, label="warmup")
                asyncio.run(bench_prompts(settings, prompts, [0.0] * 4, self.model, progress=False))

    def run_grid(self) -> None:
        """Round after round, each over every (rate, dataset) cell, the policies of a cell in
        an order rotated from cell to cell and round to round (bench/policies.interleaved)."""
        order = 0
        cells = [(rate, dataset) for rate in self.s.rates for dataset in self.s.datasets]
        total = self.s.rounds * len(cells) * len(self.policies)
        for round_index in range(self.s.rounds):
            for c_i, (rate, dataset) in enumerate(cells):
                for policy in interleaved(self.policies, round_index * len(cells) + c_i):
                    t0 = time.monotonic()
                    result, tpots = self.bench(dataset, rate, policy, round_index)
                    self.doc["runs"].append(SweepRun(dataset=dataset, rate=rate, policy=policy.name,
                                                     table=policy.table, order=order, round=round_index,
                                                     tpots_s=tpots, result=result).model_dump(mode="json"))
                    order += 1
                    self.save()
                    m = result.metrics
                    tpot = "-" if m.tpot_s.mean is None else f"{1000 * m.tpot_s.mean:.0f} ms"
                    self.log(f"[{order}/{total}] round {round_index + 1} {dataset} rate {rate:g} {policy.name}: "
                             f"mean TPOT {tpot}, {m.output_throughput:.1f} tok/s, errors {m.errors} "
                             f"({time.monotonic() - t0:.0f} s)")

    def run(self) -> dict:
        max_k = max([p.max_depth for p in self.policies] + [1])
        with tempfile.TemporaryDirectory(prefix="adaspec-sweep-") as tmp:
            config, self.url, self.start_table, notes = prepare_config(Path(self.s.config), self.out, max_k,
                                                                       self.s.profile)
            self.doc["notes"] += notes
            server = ServeProcess(config.resolve(), self.url, Path(tmp) / "serve.log",
                                  env={"ADASPEC_CONTROLLER_DIR": str(Path(tmp) / "controller")})
            server.start()
            try:
                ready_s = server.wait_ready(_model_of(config))
                self.model = served_model(self.url)
                self.log(f"deployment ready after {ready_s:.0f} s at {self.url} ({self.model}); warming up")
                self.doc["ready_s"] = ready_s
                self.warm_up()
                self.run_grid()
                if self.s.phase_trace:
                    self.doc["phase_change"] = run_phase_change(self, self.s.phase_trace)
                    self.save()
                if self.s.cross_check_rate is not None:
                    self.doc["cross_check"] = cross_check(self, self.s.cross_check_rate)
                    self.save()
            finally:
                try:
                    admin_client.controller_action(self.url, "resume")
                except admin_client.AdminError:
                    pass
                survivors = server.stop()
                self.log(f"deployment stopped; engine processes killed after graceful shutdown: {survivors or 'none'}")
        self.doc["machine"].update(machine.at_end(self.doc["machine"]))
        self.save()
        return self.doc


def _model_of(config: Path) -> str:
    args = yaml.safe_load(config.read_text())["applications"][0].get("args", {})
    return args.get("served_model_name") or args.get("model", "smollm2-135m-instruct")

