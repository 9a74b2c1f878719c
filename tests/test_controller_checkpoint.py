"""The controller's checkpoint (controller/checkpoint.py, controller/checkpoint_file.py): a
fitted controller written as versioned JSON and read back predicts and decides as before;
a bad file is set aside and the controller starts fresh; an old pickle checkpoint is
converted once. No Ray: the actor's file handling is `checkpoint_file.resume`."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle

import numpy as np
import pytest

import controller.core
from controller.checkpoint import ControllerCheckpoint
from controller.checkpoint_file import (
    CHECKPOINT_FILE,
    LEGACY_FILE,
    CheckpointError,
    resume,
    write_checkpoint,
)
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.simulate import engine_from_checkpoint
from controller.state import Deployment, Replica
from testkit.simulated_replica import CAPS, SimulatedReplica

KEY = CAPS.deployment_key("m")  # the simulated replicas' deployment in the controller

CONFIG = ControllerConfig(enabled=True, half_life_s=5.0)
# Features (batch, tokens per sequence, draft passes, context tokens, prefill tokens) around
# and beyond the steps the model was fitted on.
GRID = [[b, tokens, passes, b * context, prefill] for b in (1, 4, 16, 64) for tokens in (1.0, 2.5, 5.0)
        for passes in (0, 1, 2, 4) for context in (100, 300) for prefill in (0, 256)]


@pytest.fixture(scope="module")
def fitted():
    """(core, time): a controller fed 20 periods by one replica, its step-time model fitted
    with XGBoost."""
    core = ControllerCore(CONFIG)
    t = SimulatedReplica("r1", alpha=0.6).run(core, 0.0, periods=20, batch=4, arrivals=3)
    dep = core.deployments[KEY]
    assert len(dep.step_model.y) >= dep.step_model.min_samples_xgb
    assert dep.step_model.report.kind == "xgboost" and dep.step_model.booster is not None
    return core, t


def _restored(core: ControllerCore, config: ControllerConfig = CONFIG) -> ControllerCore:
    """A new controller loaded from `core`'s checkpoint, through its JSON text."""
    new = ControllerCore(config)
    new.load_state(ControllerCheckpoint.model_validate_json(core.state().model_dump_json()))
    return new


def test_restored_controller_predicts_and_decides_alike(fitted):
    core, t = fitted
    restored = _restored(core)
    assert restored.restored
    old_model, new_model = core.deployments[KEY].step_model, restored.deployments[KEY].step_model
    assert new_model.booster is not None and new_model.booster is not old_model.booster
    np.testing.assert_allclose(new_model.predict(GRID), old_model.predict(GRID), rtol=1e-12)
    assert new_model.report == old_model.report

    old_rep, new_rep = core.replicas["r1"], restored.replicas["r1"]
    np.testing.assert_array_equal(new_rep.acceptance.reached, old_rep.acceptance.reached)
    np.testing.assert_array_equal(new_rep.acceptance.conditional_rates(), old_rep.acceptance.conditional_rates())
    assert new_rep.policy_in_force == old_rep.policy_in_force
    assert restored.deployments[KEY].seen == core.deployments[KEY].seen

    before, after = core.view(now=t).replicas[0], restored.view(now=t).replicas[0]
    for field in ("arrival_rate", "mean_batch", "output_tokens", "expected_length", "measured_step_s",
                  "predicted_step_s", "latency_fits"):
        assert getattr(after, field) == getattr(before, field), field

    # The same decision, exploration included (it reads the steps seen and the last probe).
    a, b = core.decide("r1", now=t + 1.0), restored.decide("r1", now=t + 1.0)
    assert a.policy.rules == b.policy.rules and a.changed == b.changed
    assert a.buckets == b.buckets
    assert (a.operating_batch, a.predicted_latency_s) == (b.operating_batch, b.predicted_latency_s)


def test_settings_come_from_the_restarted_controllers_config(fitted):
    core, _ = fitted
    restored = _restored(core, ControllerConfig(enabled=True, half_life_s=7.0))
    assert restored.replicas["r1"].acceptance.half_life_s == 7.0


def test_checkpoint_is_versioned_json(fitted, tmp_path):
    core, _ = fitted
    path = tmp_path / CHECKPOINT_FILE
    write_checkpoint(path, core.state())
    data = json.loads(path.read_text())  # JSON all through: no pickle inside
    assert data["format_version"] == 2
    booster = data["deployments"][KEY]["step_model"]["booster"]
    assert isinstance(booster, str) and json.loads(booster)["learner"]  # XGBoost's own JSON model
    seen = data["deployments"][KEY]["seen"]
    assert {"batch_lo": 3, "config": "chain2"} in [{k: s[k] for k in ("batch_lo", "config")} for s in seen]
    assert not list(tmp_path.glob("*.tmp-*"))  # written atomically, nothing left over

    fresh = ControllerCore(CONFIG)
    assert resume(fresh, tmp_path) and fresh.decisions == core.decisions


def _bad_files(fitted) -> dict[str, tuple[bytes, str]]:
    core, _ = fitted
    text = core.state().model_dump_json()
    newer = json.loads(text) | {"format_version": 3}
    return {
        "not json": (b"{not json", "Invalid JSON"),
        "truncated": (text[: len(text) // 2].encode(), "Invalid JSON"),
        "newer version": (json.dumps(newer).encode(), "format_version 3; this controller reads format_version 2"),
        "wrong shape": (text.replace('"paused":', '"halted":').encode(), "not a controller checkpoint"),
    }


@pytest.mark.parametrize("case", ["not json", "truncated", "newer version", "wrong shape"])
def test_bad_checkpoint_is_set_aside_and_the_controller_starts_fresh(fitted, tmp_path, caplog, case):
    data, reason = _bad_files(fitted)[case]
    path = tmp_path / CHECKPOINT_FILE
    path.write_bytes(data)
    core = ControllerCore(CONFIG)
    with caplog.at_level(logging.ERROR, logger="adaspec.controller"):
        assert not resume(core, tmp_path)
    assert not core.restored and not core.replicas and not core.deployments
    (aside,) = tmp_path.glob(f"{CHECKPOINT_FILE}.bad-*")
    assert aside.read_bytes() == data and not path.exists()
    (record,) = caplog.records
    assert str(path) in record.getMessage() and reason in record.getMessage()
    assert str(aside) in record.getMessage()
    # The next start finds nothing to trip on.
    assert not resume(ControllerCore(CONFIG), tmp_path)


@contextlib.contextmanager
def _named_as_before():
    """Replica and Deployment under the names an earlier version gave them (controller.core's
    _Replica and _Deployment), so that a pickle written meanwhile names what that one did."""
    renamed = [(cls, cls.__module__, cls.__qualname__, old)
               for cls, old in ((Replica, "_Replica"), (Deployment, "_Deployment"))]
    for cls, _, _, old in renamed:
        cls.__module__, cls.__qualname__ = "controller.core", old
        setattr(controller.core, old, cls)
    try:
        yield
    finally:
        for cls, module, qualname, old in renamed:
            delattr(controller.core, old)
            cls.__module__, cls.__qualname__ = module, qualname


def _old_pickle(core: ControllerCore) -> bytes:
    """The pickle an earlier version wrote: ControllerCore.state() returned this dict of the
    private dataclasses, deployments keyed by model id, and pickled as the version before the
    latency fits, without the fields added since."""
    with _named_as_before():
        state = pickle.loads(pickle.dumps({"replicas": core.replicas, "deployments": {"m": core.deployments[KEY]},
                                           "paused": core.paused, "decisions": core.decisions,
                                           "pushed": core.pushed}))
        del state["deployments"]["m"].__dict__["requests"]
        del state["deployments"]["m"].__dict__["model_id"]
        del state["replicas"]["r1"].__dict__["latency_sum"]
        data = pickle.dumps(state)
    assert b"controller.core" in data and b"_Replica" in data and b"controller.state" not in data
    return data


def test_old_pickle_is_converted_once(fitted, tmp_path, caplog):
    core, t = fitted
    legacy = tmp_path / LEGACY_FILE
    legacy.write_bytes(_old_pickle(core))
    first = ControllerCore(CONFIG)
    with caplog.at_level(logging.INFO, logger="adaspec.controller"):
        assert resume(first, tmp_path)
    assert not legacy.exists() and (tmp_path / f"{LEGACY_FILE}.converted").is_file()
    assert "converted" in caplog.text and str(legacy) in caplog.text
    converted = (tmp_path / CHECKPOINT_FILE).read_bytes()
    assert json.loads(converted)["format_version"] == 2
    np.testing.assert_allclose(first.deployments[KEY].step_model.predict(GRID),
                               core.deployments[KEY].step_model.predict(GRID), rtol=1e-12)
    assert first.replicas["r1"].policy_in_force == core.replicas["r1"].policy_in_force
    # The fields the old pickle lacked start from their defaults.
    assert first.deployments[KEY].requests == {} and first.replicas["r1"].latency_sum == 0.0

    # A second start reads the JSON and leaves it as it was.
    second = ControllerCore(CONFIG)
    assert resume(second, tmp_path) and second.decisions == core.decisions
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == converted
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE, f"{LEGACY_FILE}.converted"]


@pytest.mark.parametrize("data", [b"\x80\x04not a pickle", pickle.dumps({"replicas": {}})],
                         ids=["corrupt", "another layout"])
def test_unconvertible_pickle_is_set_aside(tmp_path, caplog, data):
    legacy = tmp_path / LEGACY_FILE
    legacy.write_bytes(data)
    core = ControllerCore(CONFIG)
    with caplog.at_level(logging.ERROR, logger="adaspec.controller"):
        assert not resume(core, tmp_path)
    assert not core.restored and not legacy.exists() and not (tmp_path / CHECKPOINT_FILE).exists()
    (aside,) = tmp_path.glob(f"{LEGACY_FILE}.bad-*")
    assert aside.read_bytes() == data
    assert f"{legacy}: cannot convert" in caplog.text


def test_simulate_reads_the_json_checkpoint_and_refuses_an_old_pickle(fitted, tmp_path, capsys):
    from cli.main import main

    core, _ = fitted
    path = tmp_path / CHECKPOINT_FILE
    write_checkpoint(path, core.state())
    engine = engine_from_checkpoint(str(path))
    assert engine.model_id == "m" and engine.max_k == 4
    np.testing.assert_allclose(engine.acceptance[1:], core.replicas["r1"].acceptance.conditional_rates()[1:4, 0])

    legacy = tmp_path / LEGACY_FILE
    legacy.write_bytes(_old_pickle(core))
    with pytest.raises(CheckpointError, match="start the controller once"):
        engine_from_checkpoint(str(legacy))
    assert main(["simulate", "--checkpoint", str(legacy), "--rate", "1", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert str(legacy) in err and "start the controller once" in err
    assert legacy.is_file()  # the CLI only reads
