"""The checkpoint on disk: where it lives, how it is written and read, and what becomes of a
file that cannot be used.

- `controller.json` in the checkpoint folder: a `ControllerCheckpoint` (controller.checkpoint)
  as JSON, replaced atomically, so a reader sees the old file or the new one, never half.
- A file that does not parse, or has another format_version, is renamed aside
  (`controller.json.bad-<unix time>`) with the reason logged, and the controller starts
  fresh: a bad file must not keep a restarted controller down (Ray would restart it into the
  same error, forever).
- `controller.pkl`, the pickle earlier versions wrote, is converted once when no
  `controller.json` exists: read (its classes found where they live now), given the fields
  added since, written as `controller.json`, and renamed `controller.pkl.converted`; one
  that cannot be converted is set aside like a bad file.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import time
from pathlib import Path

from pydantic import ValidationError

from controller.checkpoint import FORMAT_VERSION, ControllerCheckpoint
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.state import Deployment, Replica

CHECKPOINT_FILE = "controller.json"
LEGACY_FILE = "controller.pkl"  # the pickle checkpoint of versions before format_version 1

logger = logging.getLogger("adaspec.controller")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


def checkpoint_dir(config: ControllerConfig) -> Path:
    """config.checkpoint_dir, else $ADASPEC_CONTROLLER_DIR, else ~/.cache/adaspec/controller."""
    root = (config.checkpoint_dir or os.environ.get("ADASPEC_CONTROLLER_DIR")
            or os.path.join(Path.home(), ".cache", "adaspec", "controller"))
    return Path(root).expanduser()


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_checkpoint(path: Path, ckpt: ControllerCheckpoint) -> None:
    """Serialize and write `ckpt` atomically. Slow for a fitted model (the booster's text
    takes hundreds of ms), so the actor runs it in a thread."""
    write_atomically(path, ckpt.model_dump_json().encode())


def read_checkpoint(path: Path) -> ControllerCheckpoint:
    """The checkpoint in `path`; CheckpointError naming the file and the reason if unusable."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e}") from None
    if data[:1] == b"\x80":  # the first byte of every pickle since protocol 2
        raise CheckpointError(
            f"{path}: a pickle checkpoint of an earlier adaspec version; start the controller once with it "
            f"as {LEGACY_FILE} in its checkpoint folder, which converts it to {CHECKPOINT_FILE}")
    try:
        return ControllerCheckpoint.model_validate_json(data)
    except ValidationError as e:
        raise CheckpointError(f"{path}: {_reason(e)}") from None


def _reason(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    for err in errors:
        if err["loc"] == ("format_version",):
            return f"format_version {err['input']!r}; this controller reads format_version {FORMAT_VERSION}"
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    return f"not a controller checkpoint ({len(errors)} error(s); first at {where}: {first['msg']})"


def set_aside(path: Path, reason: str) -> Path | None:
    """Rename an unusable checkpoint file to `<name>.bad-<unix time>` and log why; the new
    name, or None if it could not be renamed (then the next write replaces it)."""
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    try:
        os.replace(path, aside)
    except OSError as e:
        logger.error("adaspec controller: %s; cannot move it aside (%s); starting fresh", reason, e)
        return None
    logger.error("adaspec controller: %s; moved it to %s and starting fresh", reason, aside)
    return aside


def load_checkpoint(directory: Path) -> ControllerCheckpoint | None:
    """The checkpoint a controller starting in `directory` resumes from, or None to start
    fresh (no file, or an unusable one, now set aside). An old pickle is converted here."""
    path = directory / CHECKPOINT_FILE
    if path.is_file():
        try:
            return read_checkpoint(path)
        except CheckpointError as e:
            set_aside(path, str(e))
            return None
    legacy = directory / LEGACY_FILE
    if legacy.is_file():
        return _convert_legacy(legacy, path)
    return None


def resume(core: ControllerCore, directory: Path) -> bool:
    """Load the checkpoint in `directory` into a fresh `core`; whether it resumed. Never
    raises for a bad file: the controller then starts fresh."""
    ckpt = load_checkpoint(directory)
    if ckpt is None:
        return False
    try:
        core.load_state(ckpt)  # all or nothing: on failure the core stays fresh
    except Exception as e:  # a file that parses but does not restore
        set_aside(directory / CHECKPOINT_FILE, f"{directory / CHECKPOINT_FILE}: cannot restore from it: {e!r}")
        return False
    return True


# ---------------------------------------------------------------------------- old pickles
def _convert_legacy(legacy: Path, path: Path) -> ControllerCheckpoint | None:
    try:
        ckpt = convert_pickle(legacy.read_bytes())
    except Exception as e:  # classes renamed or changed since: nothing in it can be trusted
        set_aside(legacy, f"{legacy}: cannot convert this pickle checkpoint of an earlier version: {e!r}")
        return None
    try:
        write_checkpoint(path, ckpt)
        os.replace(legacy, legacy.with_name(f"{legacy.name}.converted"))
    except OSError as e:  # resume anyway; the next start converts again
        logger.error("adaspec controller: converted %s but cannot write %s or rename it (%s)", legacy, path, e)
        return ckpt
    logger.warning("adaspec controller: converted %s to %s (the old file is now %s.converted)",
                   legacy, path, legacy.name)
    return ckpt


class _LegacyUnpickler(pickle.Unpickler):
    """Finds the classes an old pickle names where they live now: controller.core's
    _Replica and _Deployment are controller.state's Replica and Deployment."""

    MOVED = {("controller.core", "_Replica"): Replica, ("controller.core", "_Deployment"): Deployment}

    def find_class(self, module: str, name: str):
        return self.MOVED.get((module, name)) or super().find_class(module, name)


def convert_pickle(data: bytes) -> ControllerCheckpoint:
    """The checkpoint in a pickle of an earlier version: the dict its ControllerCore.state()
    returned, of controller.core's _Replica and _Deployment objects. Unpickling runs code, so
    this reads only the file the controller itself wrote, once."""
    state = _LegacyUnpickler(io.BytesIO(data)).load()
    for rep in state["replicas"].values():
        _add_missing_fields(rep)
        _add_missing_fields(rep.acceptance)
    for dep in state["deployments"].values():
        _add_missing_fields(dep)
        _add_missing_fields(dep.step_model)
    # Deployments were keyed by model id then: each goes to the key of its model's replicas
    # (model, engine, accelerator); one with no replica left has nothing to resume for.
    deployments = {}
    for rep in state["replicas"].values():
        dep = state["deployments"][rep.model_id]
        dep.model_id = rep.model_id
        deployments.setdefault(rep.deployment, dep.checkpoint())
    return ControllerCheckpoint(
        replicas={rid: rep.checkpoint() for rid, rep in state["replicas"].items()},
        deployments=deployments, paused=state["paused"], decisions=state["decisions"], pushed=state["pushed"])


def _add_missing_fields(obj) -> None:
    """Give a dataclass object unpickled from an older version the fields added since."""
    for f in dataclasses.fields(obj):
        if not hasattr(obj, f.name):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(obj, f.name, default)
