"""Where a run's figures are written: TensorBoard event files in WORKDIR/tensorboard (written by
tensorboardX, so no process imports TensorFlow), WORKDIR/metrics.jsonl and optionally Weights & Biases,
beside the console line (`metrics.ConsoleWriter`), all behind one `MultiWriter`, on process 0 only.

A remote workdir (`gs://bucket/run`) is written through a local `Staging` directory: object
stores cannot append, so the files grow locally and each changed one is copied whole to the
workdir at most every `SYNC_SECS` seconds, on `flush` and on `close`. The profiler's trace
goes through one too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from etils import epath

from mintrain.errors import ConfigError, StorageError
from mintrain.metrics import Console, ConsoleWriter, MetricsConfig, Scalars
from mintrain.runtime.storage import free_bytes, is_remote, prepare_dir


def _import_tensorboardx() -> None:
  """At the first TensorBoard writer, not at import. tensorboardX's package import would load torch (to
  accept torch tensors, which mintrain never passes) into every run where torch is installed: that one
  import is refused, unless torch is loaded already, and `sys.modules` is put back at once."""
  if 'tensorboardX' not in sys.modules and 'torch' not in sys.modules:
    sys.modules['torch'] = None  # type: ignore[assignment]  # `import torch` raises ImportError.
    try:
      import tensorboardX  # noqa: F401
    finally:
      del sys.modules['torch']


SYNC_SECS = 60.0  # How often at most a remote workdir's metrics are copied there while the run writes.


class Writer(Protocol):
  """What the train loop writes to: scalars at every logged step, hyperparameters once."""

  def write_scalars(self, step: int, scalars: Scalars) -> None: ...

  def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...

  def flush(self) -> None: ...

  def close(self) -> None:
    """Idempotent: a second call does nothing."""


@contextlib.contextmanager
def _writing(path: pathlib.Path) -> Iterator[None]:
  """Turns a failed local write into a one-line StorageError naming the path, the reason and the free
  space (a full disk, a read-only file system)."""
  try:
    yield
  except OSError as e:
    free = free_bytes(path if path.is_dir() else path.parent)
    space = f', {free:,} bytes free' if free is not None else ''
    raise StorageError(f'Writing {path} failed ({e.strerror or e}{space}).') from e


ATTEMPT = 'attempt'  # WORKDIR/attempt: how many runs have started writing to the workdir.


def next_attempt(workdir: str | os.PathLike) -> int:
  """Counts one more run writing to `workdir` and returns its number (1 for the first)."""
  path = epath.Path(workdir) / ATTEMPT
  text = path.read_text().strip() if path.exists() else ''
  attempt = (int(text) if text.isdigit() else 0) + 1
  with _writing(path):
    path.write_text(f'{attempt}\n')
  return attempt


class JsonlWriter:
  """`metrics.jsonl`: one JSON object per record, with the run's `attempt`, so that the records of a step
  logged again after a crash and resume are told apart; hyperparameters go to `hparams.json`."""

  def __init__(self, workdir: pathlib.Path, attempt: int):
    self.path = workdir / 'metrics.jsonl'
    self.hparams_path = workdir / 'hparams.json'
    self.attempt = attempt

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    record = {'step': int(step), 'attempt': self.attempt, **{k: float(v) for k, v in scalars.items()}}
    with _writing(self.path), self.path.open('a') as f:
      f.write(json.dumps(record) + '\n')

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    with _writing(self.hparams_path):
      self.hparams_path.write_text(json.dumps(dict(hparams), indent=1, sort_keys=True) + '\n')

  def flush(self) -> None:
    pass  # Each record is closed as it is written.

  def close(self) -> None:
    pass


class TensorBoardWriter:
  """Event files in `logdir`: one scalar per tag and step, and the hyperparameters as the session start
  of TensorBoard's HParams plugin, which then offers every scalar tag as a metric (as `hp.hparams` does).

  Written in the caller's thread (tensorboardX's `EventsWriter`, not its `SummaryWriter`, whose writer
  thread would print a full disk's error as a traceback that no caller can catch).
  """

  def __init__(self, logdir: pathlib.Path):
    _import_tensorboardx()
    from tensorboardX import event_file_writer, summary
    from tensorboardX.proto import event_pb2
    self.logdir, self.summary, self.event = logdir, summary, event_pb2.Event
    with _writing(logdir):
      logdir.mkdir(parents=True, exist_ok=True)
      # The name has the time in seconds and the host; the suffix keeps two writers of one second apart.
      self.events: Any = event_file_writer.EventsWriter(str(logdir / 'events'), f'.{uuid.uuid4().hex[:8]}')

  def _write(self, **event: Any) -> None:
    if self.events is not None:
      with _writing(self.logdir):
        self.events.write_event(self.event(wall_time=time.time(), **event))

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    for tag, value in scalars.items():
      self._write(step=int(step), summary=self.summary.scalar(tag, float(value)))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    _, session_start, _ = self.summary.hparams(dict(hparams), {})
    self._write(summary=session_start)

  def flush(self) -> None:
    if self.events is not None:
      with _writing(self.logdir):
        self.events.flush()

  def close(self) -> None:
    events, self.events = self.events, None
    if events is not None:
      with _writing(self.logdir):
        events.close()


WANDB_RUN_ID = 'wandb_run_id'  # WORKDIR/wandb_run_id: the W&B run a resumed run continues.


class WandbWriter:
  """A Weights & Biases run (files in WORKDIR/wandb): the same scalars as TensorBoard, the config and
  the run's `metadata` (sharding report, memory plan) in its config. The run's id is kept in the workdir, so
  a resumed run continues the same W&B run."""

  def __init__(self, cfg: MetricsConfig, local: pathlib.Path, metadata: Mapping[str, Any]):
    import wandb  # An optional extra: `check_wandb` said how to install it.

    id_path = local / WANDB_RUN_ID
    run_id = id_path.read_text().strip() if id_path.exists() else uuid.uuid4().hex[:8]
    with _writing(local):
      id_path.write_text(run_id + '\n')
      (local / 'wandb').mkdir(exist_ok=True)
    self.run = wandb.init(
        project=cfg.wandb_project, entity=cfg.wandb_entity or None, name=cfg.wandb_run_name or None,
        tags=[t.strip() for t in cfg.wandb_tags.split(',') if t.strip()] or None, mode=cfg.wandb_mode,
        dir=str(local), id=run_id, resume='allow', config=dict(metadata),
        settings=wandb.Settings(console='off', silent=True, x_disable_stats=True))

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self.run.config.update(dict(hparams), allow_val_change=True)

  def flush(self) -> None:
    pass  # W&B's own process streams the records.

  def close(self) -> None:
    run, self.run = self.run, None
    if run is not None:
      run.finish()


def check_wandb(cfg: MetricsConfig) -> None:
  """A ConfigError, before the run writes, when W&B is asked for and not installed."""
  if cfg.wandb_project and importlib.util.find_spec('wandb') is None:
    raise ConfigError(f"metrics.wandb_project={cfg.wandb_project!r} needs Weights & Biases: "
                      f"pip install -e '.[wandb]' (or pip install wandb).")


class Staging:
  """A local directory that stands for `target`: `target` itself when it is local; for a remote one
  (`gs://...`), a temporary directory whose new or changed files `sync` copies there whole (object stores
  cannot append), and which `close` syncs and removes.

  `fetch` names files copied from `target` first, so that a resumed run appends to them.
  """

  def __init__(self, target: str | os.PathLike, fetch: Sequence[str] = ()):
    self.target = epath.Path(target) if is_remote(target) else None
    self._copied: dict[str, tuple[int, int]] = {}  # Relative path -> (size, mtime) when last copied.
    self._last_sync = float('-inf')
    if self.target is None:
      self.local = pathlib.Path(os.path.abspath(target))
      with _writing(self.local):
        self.local.mkdir(parents=True, exist_ok=True)
      return
    self.local = pathlib.Path(tempfile.mkdtemp(prefix='mintrain_staging_'))
    with self._remote('reading'):
      for name in fetch:
        if (self.target / name).exists():
          (self.local / name).write_bytes((self.target / name).read_bytes())
          self._copied[name] = self._version(self.local / name)

  @staticmethod
  def _version(path: pathlib.Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns

  @contextlib.contextmanager
  def _remote(self, doing: str) -> Iterator[None]:
    try:
      yield
    except OSError as e:
      raise StorageError(f'{doing.capitalize()} {self.target} failed ({e.strerror or e}).') from e

  def due(self) -> bool:
    """Whether a remote target was last synced SYNC_SECS or more ago (never, for a local one)."""
    return self.target is not None and time.monotonic() - self._last_sync >= SYNC_SECS

  def sync(self) -> None:
    """Copies every file written or changed since the last sync to a remote target."""
    if self.target is None:
      return
    with self._remote('writing to'):
      for path in sorted(p for p in self.local.rglob('*') if p.is_file()):
        name, version = path.relative_to(self.local).as_posix(), self._version(path)
        if self._copied.get(name) != version:
          (self.target / name).parent.mkdir(parents=True, exist_ok=True)
          (self.target / name).write_bytes(path.read_bytes())
          self._copied[name] = version
    self._last_sync = time.monotonic()

  def close(self) -> None:
    """Syncs a remote target and removes the local stand-in, even if the sync fails; idempotent."""
    if self.target is None or not self.local.exists():
      return
    try:
      self.sync()
    finally:
      shutil.rmtree(self.local, ignore_errors=True)


class MultiWriter:
  """Passes every call on to each of `writers`; with none, a writer that does nothing. With `staging`
  (a remote workdir), syncs it at most every SYNC_SECS seconds, on `flush` and on `close`."""

  def __init__(self, writers: Sequence[Writer] = (), staging: Staging | None = None):
    self.writers, self.staging = list(writers), staging

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    for writer in self.writers:
      writer.write_scalars(step, scalars)
    if self.staging is not None and self.staging.due():
      self.flush()

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    for writer in self.writers:
      writer.write_hparams(hparams)

  def flush(self) -> None:
    for writer in self.writers:
      writer.flush()
    if self.staging is not None:
      self.staging.sync()

  def close(self) -> None:
    """Closes every writer, and then the staging directory, even if one fails; raises the first error."""
    errors = []
    for close in [w.close for w in self.writers] + ([self.staging.close] if self.staging else []):
      try:
        close()
      except Exception as e:  # The first one is raised below.
        errors.append(e)
    if errors:
      raise errors[0]

  def __enter__(self) -> MultiWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    """Closes; with an exception already on its way out, a failure to close does not replace it."""
    if exc_type is None:
      self.close()
      return
    with contextlib.suppress(Exception):
      self.close()


def make_writer(workdir: str | os.PathLike | None, *, is_main: bool, total_steps: int,
                print_fn: Callable[[str], None] = print, console: Console | None = None,
                cfg: MetricsConfig | None = None,
                metadata: Mapping[str, Any] | None = None) -> MultiWriter:
  """Console + TensorBoard + metrics.jsonl (+ W&B with `cfg.wandb_project`, given `metadata`) on process 0;
  nothing elsewhere. Counts the run's attempt.

  A workdir that is a file, or on a read-only or full file system, is a StorageError here; a remote one
  is written through a `Staging` directory (metrics.jsonl fetched first, so a resumed run appends).
  """
  if not is_main:
    return MultiWriter()
  writers: list[Writer] = [ConsoleWriter(console or Console(print_fn), total_steps)]
  if workdir is None:
    return MultiWriter(writers)
  workdir = prepare_dir(workdir)
  staging = Staging(workdir, fetch=('metrics.jsonl', WANDB_RUN_ID)) if is_remote(workdir) else None
  local = staging.local if staging is not None else pathlib.Path(workdir)
  writers += [TensorBoardWriter(local / 'tensorboard'), JsonlWriter(local, next_attempt(workdir))]
  if cfg is not None and cfg.wandb_project:
    writers.append(WandbWriter(cfg, local, metadata or {}))
  return MultiWriter(writers, staging)


def flat_hparams(config: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """Nested config -> {'model.embed_dim': 128, ...} with TensorBoard-friendly values."""
  out = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(flat_hparams(value, f'{name}.'))
    elif isinstance(value, (bool, int, float, str)):
      out[name] = value
    else:
      out[name] = str(value)
  return out
