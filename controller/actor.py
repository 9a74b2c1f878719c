"""The controller as a Ray actor: one named, detached, restartable actor per Ray cluster.

Replicas call `report(telemetry)` every control period and apply the policy it returns (if
any); a replica that stops reporting is dropped. The actor refits step-time models in a
thread and checkpoints its state every few periods (controller.checkpoint_file), so a
restarted actor (Ray restarts it after a crash, `max_restarts=-1`) resumes with its models and
policies. While it is down, replicas keep serving on their last policy.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from adaspec.telemetry import ControllerReply, ReplicaTelemetry
from controller.checkpoint_file import CHECKPOINT_FILE, checkpoint_dir, resume, write_checkpoint
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.metrics import ControllerMetrics
from controller.view import ControllerView

CONTROLLER_NAME = "adaspec-controller"
NAMESPACE = "adaspec"
CHECKPOINT_EVERY_PERIODS = 5
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node one of these
WATCH_TICKS_PER_PERIOD = 4  # checks for overdue replicas per control period

logger = logging.getLogger("adaspec.controller")


@ray.remote(num_cpus=0, max_restarts=-1)
class ControllerActor:
    def __init__(self, config: ControllerConfig):
        self.config = config
        self.core = ControllerCore(config)
        directory = checkpoint_dir(config)
        self.path = directory / CHECKPOINT_FILE
        try:
            if resume(self.core, directory):
                logger.info("adaspec controller: resumed from %s", self.path)
        except Exception:  # a checkpoint must not keep the controller down, whatever it holds
            self.core = ControllerCore(config)
            logger.exception("adaspec controller: cannot resume from %s; starting fresh", self.path)
        self.metrics = ControllerMetrics(self.core)
        self._writing = asyncio.Lock()  # one checkpoint write at a time, in order
        self._upkeep: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None

    def _ensure_upkeep(self) -> None:
        loop = asyncio.get_running_loop()
        if self._upkeep is None or self._upkeep.done():
            self._upkeep = loop.create_task(self._upkeep_forever())
        if self._watch is None or self._watch.done():
            self._watch = loop.create_task(self._watch_late_forever())

    async def _watch_late_forever(self) -> None:
        """A few times a period, ask Ray about the replicas whose report is overdue (each at
        most once a period) and drop those whose actor died: a killed replica is gone within
        about two periods, long before replica_timeout_s of silence."""
        asked: dict[str, float] = {}  # replica -> unix seconds Ray was last asked about it
        while True:
            await asyncio.sleep(self.config.period_s / WATCH_TICKS_PER_PERIOD)
            try:
                now = time.time()
                late = {rid: actor for rid, actor in self.core.late(now).items()
                        if now - asked.get(rid, 0.0) >= self.config.period_s}
                if late:
                    asked.update(dict.fromkeys(late, now))
                    dead = self.core.drop(await asyncio.to_thread(_dead, late), "its actor died")
                    self.metrics.forget(dead)
                    for rid in dead:
                        logger.info("adaspec controller: replica %s dropped (its actor died)", rid)
                for rid in [rid for rid in asked if rid not in self.core.replicas]:
                    del asked[rid]
            except Exception:
                logger.exception("adaspec controller: checking late replicas failed")

    async def _upkeep_forever(self) -> None:
        periods = 0
        last_refit = 0.0
        while True:
            await asyncio.sleep(self.config.period_s)
            periods += 1
            try:
                now = time.time()
                silent = self.core.drop_stale(now)
                self.metrics.forget(silent)
                for rid in silent:
                    logger.info("adaspec controller: replica %s dropped (silent)", rid)
                if now - last_refit >= self.config.refit_every_s:
                    last_refit = now
                    for model_id, job in self.core.refit_jobs().items():
                        report = await asyncio.to_thread(job.fit)
                        self.core.install_fit(model_id, job)
                        logger.info("adaspec controller: step-time model of %s: %s", model_id, report)
                if periods % CHECKPOINT_EVERY_PERIODS == 0:
                    await self.checkpoint()
            except Exception:
                logger.exception("adaspec controller: upkeep failed")

    async def report(self, telemetry: ReplicaTelemetry) -> ControllerReply:
        """A replica's telemetry in, a new policy (or none, or a request for its info) out."""
        self._ensure_upkeep()
        decisions = self.core.decisions
        reply = self.core.report(telemetry)
        try:
            self.metrics.observe(self.core, telemetry, self.core.decisions - decisions, reply.policy is not None)
        except Exception:  # metrics never cost a replica its policy
            logger.exception("adaspec controller: exporting metrics failed")
        return reply

    async def view(self) -> ControllerView:
        self._ensure_upkeep()
        return self.core.view()

    async def set_paused(self, paused: bool) -> ControllerView:
        self.core.paused = paused
        await self.checkpoint()
        return self.core.view()

    async def checkpoint(self) -> str:
        async with self._writing:  # so an older snapshot never lands after a newer one
            # The snapshot is taken on the event loop, where no report can change the models
            # mid-copy; serializing it (the booster's text: hundreds of ms) and the write run
            # in a thread.
            ckpt = self.core.state()
            await asyncio.to_thread(write_checkpoint, self.path, ckpt)
        return str(self.path)


def _dead(replicas: dict[str, str]) -> list[str]:
    """The replicas (id -> Ray actor id) whose actors Ray reports dead; a replica Ray cannot
    tell about is left to the silence timeout."""
    from ray.util.state import get_actor

    dead = []
    for rid, actor_id in replicas.items():
        try:
            state = get_actor(actor_id, timeout=2)
        except Exception:  # the state API unreachable: nothing learned
            continue
        if state is not None and state.state == "DEAD":
            dead.append(rid)
    return dead


def get_or_create_controller(config: ControllerConfig):
    """The cluster's controller actor, created by whichever replica asks first."""
    # scheduling_strategy="DEFAULT": a replica runs inside its placement group with child
    # capture on, and a controller captured there would die with the first replica that asks.
    # On the head node (Ray's own resource there, as Serve's controller does): a worker node
    # lost must not take the controller with it.
    return ControllerActor.options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy="DEFAULT", resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(config)


def get_controller():
    """The running controller actor; raises ValueError if there is none."""
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
