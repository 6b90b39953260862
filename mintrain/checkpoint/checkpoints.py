"""Sharded, asynchronous checkpoints with Orbax's CheckpointManager.

A run directory holds `checkpoints/<step>/` with three items: `state` (params, optimizer state, step and
PRNG key; OCDBT arrays), `data` (the input pipeline's position) and `metadata` (the config, the mesh, the
versions and every array's logical axes; JSON). A step is listed only once complete. Restoring targets the
*current* mesh's abstract state, so each device reads only its own shard, and converts between stacked and
per-layer layouts (`Relayout`). Paths are local (made absolute) or `gs://` URLs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
from etils import epath

import mintrain
from mintrain import mesh as mesh_lib
from mintrain.checkpoint.relayout import Relayout
from mintrain.errors import CheckpointError, DamagedCheckpointError, DiskFullError, StorageError
from mintrain.fields import option
from mintrain.runtime import distributed
from mintrain.runtime.lazy import lazy_import
from mintrain.runtime.storage import first_line, free_bytes, is_remote, os_reason, prepare_dir, run_path
from mintrain.train_state import TrainState, flat_logical_axes, path_str

ocp = lazy_import('orbax.checkpoint')  # Loaded by the first save or restore.
# The full story of a failed read: to the run's log (`actions.RunLog`), never the console.
_details = logging.getLogger('mintrain.details')



@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = option(at_least=0)
  keep: int = option(at_least=0)
  fallback_to_previous: bool = option()


CHECKPOINTS = 'checkpoints'
DAMAGED = '.damaged'  # Suffix of a damaged step directory moved aside by a fallback.
LOGICAL_AXES = 'logical_axes'  # Metadata key: {array path: its logical axes}, for `Relayout`.


def save_bytes(tree: Any, *json_items: Any) -> int:
  """About what a save of `tree` and the JSON items writes: every array once (OCDBT keeps one copy of
  replicated shards), plus 2% and 64 KiB for the index and metadata files beside them."""
  arrays = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, 'dtype'))
  texts = sum(len(json.dumps(item, default=str)) for item in json_items)
  return int((arrays + texts) * 1.02) + 64 * 1024


def _manager_class() -> type:
  """Orbax's CheckpointManager that never asks JAX's preemption sync point (the loop decides each save): its
  global step numbers would skew the counter that the processes' agreed stop relies on (`preemption`)."""

  class Manager(ocp.CheckpointManager):
    def reached_preemption(self, step: int) -> bool:
      return False

  return Manager


def _chain(e: BaseException | None):
  """`e` and the exceptions it was raised from."""
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


def _is_disk_full(e: BaseException | None) -> bool:
  """Whether `e` or an exception it was raised from says the disk (or the quota) is full."""
  return any((isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT))
             or 'No space left on device' in str(x) or 'Disk quota exceeded' in str(x) for x in _chain(e))


# TensorStore's status codes for a file that is missing, shorter than its index says, or does not decode.
_DAMAGE_CODES = ('NOT_FOUND', 'DATA_LOSS', 'OUT_OF_RANGE', 'FAILED_PRECONDITION')


def _is_damage(e: BaseException) -> bool:
  """Whether a failed read is the checkpoint's own damage (missing or unreadable files, undecodable arrays or
  metadata), which an older checkpoint may not share; anything else (out of memory, a sharding bug) is not."""
  return any(isinstance(x, (OSError, json.JSONDecodeError))
             or (isinstance(x, ValueError) and str(x).startswith(_DAMAGE_CODES)) for x in _chain(e))


def _note_not_damage(e: Exception, what: str) -> None:
  """Notes on `e`, raised as it is, what it interrupted and that it was not taken for damage."""
  e.add_note(f'{what}; this is not damage to the files, so no older checkpoint was tried.')


def versions() -> dict[str, str]:
  names = ('mintrain', 'jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint')
  out = {}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = mintrain.__version__ if name == 'mintrain' else 'unknown'
  return out


def state_tree(state: TrainState) -> dict[str, Any]:
  """The saved form of a state: a plain dict, so that parts of it can be restored alone (the objective's
  reference model only where it keeps one)."""
  tree = {'step': state.step, 'params': state.params, 'opt_state': state.opt_state, 'rng': state.rng}
  return tree if state.reference is None else {**tree, 'reference': state.reference}


def _leaves(tree: Any) -> dict[str, Any]:
  return {path_str(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def find_run_checkpoints(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
  """(checkpoints directory, step or None for the newest) for a run, checkpoints or step directory,
  local or remote (`gs://bucket/run`)."""
  path = run_path(path)
  try:
    return _find_run_checkpoints(path)
  except ImportError as e:
    raise StorageError(f'{path} cannot be reached: {first_line(e)}') from e
  except OSError as e:
    raise StorageError(f'{path} cannot be read ({os_reason(e)}).') from e


def _find_run_checkpoints(path: epath.Path) -> tuple[epath.Path, int | None]:
  if not path.exists():
    raise CheckpointError(f'{path}: no such file or directory.')
  if not path.is_dir():
    raise StorageError(f'{path} is a file, not a run directory or a checkpoint step directory.')
  if (path / CHECKPOINTS).is_dir():
    path = path / CHECKPOINTS
  if path.name.isdigit() and (path / 'state').is_dir():
    return path.parent, int(path.name)
  if any(child.name.isdigit() and (child / 'state').is_dir() for child in path.iterdir()):
    return path, None
  if path.name == CHECKPOINTS or not any(path.iterdir()):
    raise CheckpointError(f'{path} holds no complete checkpoint (no step directories with saved state).')
  raise CheckpointError(
      f'{path} is not a mintrain checkpoint: expected a run directory (with {CHECKPOINTS}/), '
      f'its {CHECKPOINTS}/ directory, or one step directory inside it.')


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore read: the state tree (a dict of TrainState's fields, or only `params`), the input
  pipeline's position and the metadata saved with it."""

  step: int
  state: dict[str, Any]
  data: dict[str, Any]
  metadata: dict[str, Any]

  @property
  def mesh(self) -> str:
    """The mesh it was saved on, as `mesh.describe` writes it."""
    return mesh_lib.describe(self.metadata.get('mesh', {})) or 'unknown'


class Checkpoints:
  """The checkpoints of one run directory: when to save, how many to keep, how to restore."""

  def __init__(self, directory: str | os.PathLike, *, keep: int = 1, read_only: bool = False):
    if is_remote(directory) and not os.fspath(directory).startswith('gs://'):
      raise StorageError(f'{os.fspath(directory)}: checkpoints go to local paths or gs:// only (Orbax writes '
                         "arrays through TensorStore's file and GCS drivers).")
    self.directory = run_path(directory) if read_only else prepare_dir(directory, 'checkpoint directory')
    self.read_only = read_only
    self._pending: tuple[int, int] | None = None  # (step, bytes it needs) of the save in flight.
    # `read_only` here means: never create, clean up or save (Orbax's own flag only warns). Orbax's own
    # clean-up runs in a thread that only a save waits for (a run that fails before its first save would
    # exit under it); `_remove_partial_saves` is synchronous.
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max(keep, 1)), enable_async_checkpointing=True,
        cleanup_tmp_directories=False, create=not read_only)
    # Handlers named up front, so metadata can be read before (or without) any restore.
    registry = _array_handlers()
    state = (ocp.PyTreeCheckpointHandler(type_handler_registry=registry) if registry is not None
             else ocp.PyTreeCheckpointHandler())
    handlers = {'state': state, 'data': ocp.JsonCheckpointHandler(), 'metadata': ocp.JsonCheckpointHandler()}
    if not read_only:
      self._remove_partial_saves()
    self.manager = _manager_class()(self.directory, options=options, item_handlers=handlers)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def newest_step(self) -> int:
    """The newest saved step (0 if none), as the manager last listed or saved it: no reads."""
    return self.manager.latest_step() or 0

  def save(self, step: int, state: TrainState, *, data_state: Mapping[str, Any],
           metadata: Mapping[str, Any]) -> None:
    """Starts an asynchronous save, after finishing the previous one (so its failure names its own step)
    and refusing one that cannot fit on a local disk; returns once the arrays are off the devices."""
    self.wait()
    tree = state_tree(state)
    metadata = {**metadata, LOGICAL_AXES: {k: v for k, v in flat_logical_axes(tree).items() if v is not None}}
    needed = save_bytes(tree, dict(data_state), metadata)
    self._refuse_if_full(step, needed)
    args = ocp.args.Composite(
        state=ocp.args.PyTreeSave(tree),
        data=ocp.args.JsonSave(dict(data_state)),
        metadata=ocp.args.JsonSave(metadata))
    self._pending = (step, needed)
    try:
      self.manager.save(step, args=args, force=True)
    except Exception as e:
      raise self._save_failed(e) from e

  def _refuse_if_full(self, step: int, needed: int) -> None:
    free = free_bytes(self.directory)
    if free is not None and free < needed:
      raise DiskFullError(f'Not enough disk space to save checkpoint step {step} under {self.directory}: '
                          f'{self._space(needed, free)}')

  def wait(self) -> None:
    """Finishes the save in flight; its failure (a full disk, in the background) is raised here."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._save_failed(e) from e
    self._pending = None

  def _save_failed(self, e: Exception) -> CheckpointError:
    """The one-line error for a failed save, once the partial save is removed."""
    step, needed = self._pending if self._pending is not None else (None, None)
    what = f'checkpoint step {step}' if step is not None else 'a checkpoint'
    self._remove_partial_saves()
    if _is_disk_full(e) and needed is not None:
      free = free_bytes(self.directory)
      return DiskFullError(f'Saving {what} under {self.directory} ran out of disk space (its partial files '
                           f'are removed): {self._space(needed, free)}')
    return CheckpointError(f'Saving {what} under {self.directory} failed: {first_line(e)}')

  def _space(self, needed: int, free: int | None) -> str:
    """What a full disk needs: the bytes, the free space, what to do, and that nothing saved is lost."""
    free_text = f'{free:,} bytes are free' if free is not None else 'the free space is unknown'
    text = (f'the save needs about {needed:,} bytes and {free_text}. Free some space or use a workdir on '
            'another disk')
    try:
      steps = self.steps()
    except Exception:  # The message matters more than the list.
      return text + '.'
    if not steps:
      return text + '; no checkpoint was saved before.'
    return text + f'; the checkpoints saved before (steps {", ".join(map(str, steps))}) are intact.'

  def _remove_partial_saves(self) -> None:
    """Removes unfinished saves (Orbax's tmp directories; on gs://, steps without `commit_success.txt`)
    on process 0, now rather than in the background, so that a full disk gets its space back."""
    if jax.process_index() != 0:
      return
    with contextlib.suppress(OSError):
      for child in self.directory.iterdir():
        if _is_unfinished(child):
          child.rmtree(missing_ok=True)

  def close(self) -> None:
    self.manager.close()

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def metadata(self, step: int) -> dict[str, Any]:
    restored = self.manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return dict(restored.metadata)

  def _recorded_axes(self, step: int) -> dict[str, Any]:
    """The logical axes saved with `step`; none for checkpoints from before they were (or unreadable)."""
    try:
      return self.metadata(step).get(LOGICAL_AXES, {})
    except Exception:  # A damaged metadata file is reported by the restore that needs it.
      return {}

  def array_metadata(self, step: int) -> dict[str, Any]:
    """Path -> Orbax ArrayMetadata (shape, dtype, saved sharding) of every saved array; reads no array."""
    return _leaves(self._metadata_tree(step))

  def _metadata_tree(self, step: int) -> Any:
    """The saved state's tree (its containers as saved) with ArrayMetadata leaves."""
    try:
      tree = self.manager.item_metadata(step)['state']
    except Exception as e:
      if not _is_damage(e):
        _note_not_damage(e, f'Reading the array metadata of checkpoint step {step} at {self.step_dir(step)}')
        raise
      raise DamagedCheckpointError(f'Checkpoint step {step} at {self.step_dir(step)} is damaged: its array '
                            f'metadata cannot be read ({first_line(e)}).') from e
    if tree is None:
      raise DamagedCheckpointError(f'Checkpoint step {step} at {self.step_dir(step)} is damaged: '
                                   'no state metadata.')
    return tree.tree if hasattr(tree, 'tree') else tree

  def check_shapes(self, step: int, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raises listing every array whose saved shape or presence differs from the target's (both flat
    {path: array or metadata}, `saved` as `array_metadata(step)` gives it)."""
    problems = {}
    for path, x in expected.items():
      if path not in saved:
        problems[path] = f'{path}: not in the checkpoint, expected {tuple(x.shape)}'
      elif tuple(saved[path].shape) != tuple(x.shape):
        problems[path] = f'{path}: saved {tuple(saved[path].shape)}, expected {tuple(x.shape)}'
    top = {p.split('.')[0] for p in expected}
    problems.update({path: f'{path}: saved {tuple(m.shape)}, not in the configured model'
                     for path, m in saved.items() if path not in expected and path.split('.')[0] in top})
    # Parameters first: the optimizer state only mirrors them.
    problems = [problems[p] for p in sorted(problems, key=lambda p: (not p.startswith('params.'), p))]
    if problems:
      listing = '; '.join(problems[:12]) + (f'; and {len(problems) - 12} more' if len(problems) > 12 else '')
      raise CheckpointError(
          f'Checkpoint step {step} at {self.step_dir(step)} does not match the configured model '
          f'({len(problems)} mismatched arrays): {listing}. Use the model config it was saved with '
          f'(scripts/inspect_checkpoint.py {self.step_dir(step)} shows it).')

  def restore(self, step: int, abstract_state: TrainState, *, params_only: bool = False) -> Restored:
    """`step` laid out as `abstract_state` (the current mesh), only `params` with `params_only`; layers
    stacked differently are read in their own layout, then converted (`Relayout`)."""
    target = state_tree(abstract_state)
    if params_only:
      target = {'params': target['params']}
    target_arrays, target_axes = _leaves(target), flat_logical_axes(target)
    saved_tree = self._metadata_tree(step)
    saved_arrays = _leaves(saved_tree)
    # The recorded axes matter only when the layouts differ; a plain resume does not read them.
    recorded = self._recorded_axes(step) if set(target_arrays) - set(saved_arrays) else {}
    relayout = Relayout.plan({p: (tuple(x.shape), target_axes[p]) for p, x in target_arrays.items()},
                             {p: tuple(recorded[p]) if p in recorded else None for p in saved_arrays})
    source = target
    if relayout:  # Read the checkpoint in its own layout (and containers), then convert.
      flat = relayout.saved_layout(target_arrays)
      self.check_shapes(step, saved_arrays, flat)
      source = jax.tree_util.tree_map_with_path(lambda path, _: flat[path_str(path)],
                                                {key: saved_tree[key] for key in target})
    else:
      self.check_shapes(step, saved_arrays, target_arrays)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=_restore_args(source, partial=params_only or bool(relayout)),
          data=ocp.args.JsonRestore(),
          metadata=ocp.args.JsonRestore()))
    except Exception as e:
      if not _is_damage(e):
        _note_not_damage(e, f'Restoring checkpoint step {step} at {self.step_dir(step)}')
        raise
      bad = self._unreadable_arrays(step, source)
      what = f'array(s) {", ".join(bad)}' if bad else 'its data or metadata files'
      raise DamagedCheckpointError(f'Checkpoint step {step} at {self.step_dir(step)} is damaged: cannot read '
                                   f'{what} ({first_line(e)}).') from e
    state = dict(restored.state)
    if relayout:
      flat = relayout.apply(_leaves(state), target_arrays)
      leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
      state = jax.tree_util.tree_unflatten(treedef, [flat[path_str(path)] for path, _ in leaves])
    return Restored(step, state, dict(restored.data or {}), dict(restored.metadata or {}))

  def _unreadable_arrays(self, step: int, target: Any) -> list[str]:
    """Restores arrays one at a time to name the ones that fail (only after a failed restore)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    bad = []
    for i, (path, _) in enumerate(flat):
      # The target's own structure (Orbax keeps optimizer tuples as lists), every other leaf skipped.
      probe = treedef.unflatten([leaf if j == i else ocp.PLACEHOLDER for j, (_, leaf) in enumerate(flat)])
      try:
        self.manager.restore(step, args=ocp.args.Composite(state=_restore_args(probe, False)))
      except Exception:
        bad.append(path_str(path))
    return bad

  def restore_newest(self, abstract_state: TrainState, *, params_only: bool, fallback: bool,
                     warn: Callable[[str], None]) -> Restored:
    """The newest intact checkpoint; older ones are tried, with a warning, only if `fallback`. The damaged
    steps fallen back from are then moved aside (unless read-only), so the run saves those steps anew and
    retention never keeps them over the intact one."""
    steps = self.steps()
    if not steps:
      raise CheckpointError(f'{self.directory} holds no complete checkpoint.')
    *older, newest = steps
    damaged = []
    while True:
      try:
        restored = self.restore(newest, abstract_state, params_only=params_only)
        break
      except DamagedCheckpointError as e:
        if not older:
          raise CheckpointError(f'{e} There is no older checkpoint to fall back to.') from e
        if not fallback:
          raise CheckpointError(f'{e} Set checkpoint.fallback_to_previous=True to restore step '
                                f'{older[-1]} instead.') from e
        warn(f'warning: {e} Falling back to step {older[-1]}.')
        _details.info('Checkpoint step %d could not be read:', newest, exc_info=e)
        damaged.append(newest)
        newest = older.pop()
    if damaged:
      # Orbax's other failed reads report their errors (as unraisable) when they are collected: now,
      # while the run's log takes them, not whenever the collector runs, or at exit.
      gc.collect()
      if not self.read_only:
        self._move_aside(damaged, warn)
    return restored

  def _move_aside(self, steps: list[int], warn: Callable[[str], None]) -> None:
    """Renames damaged step directories to `<step>.damaged` (kept for inspection, never listed as steps)."""
    if jax.process_index() == 0:
      for step in steps:
        target, n = self.directory / f'{step}{DAMAGED}', 1
        while target.exists():
          n += 1
          target = self.directory / f'{step}{DAMAGED}.{n}'
        self.step_dir(step).rename(target)
        warn(f'Moved the damaged checkpoint step {step} aside to {target}.')
    distributed.barrier('mintrain: damaged checkpoints moved aside')
    self.manager.reload()


def _array_handlers() -> ocp.type_handlers.TypeHandlerRegistry | None:
  """On one host, no replica-parallel writes: their small XLA programs cost the first save a compile, and
  they pay off only when several hosts share the writes (BENCHMARKS.md). None keeps Orbax's default."""
  if jax.process_count() > 1:
    return None
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))


def _is_unfinished(path: epath.Path) -> bool:
  if '.orbax-checkpoint-tmp' in path.name:
    return True
  return (is_remote(path) and path.name.isdigit() and path.is_dir()
          and not (path / 'commit_success.txt').exists())


def _restore_args(target: Any, partial: bool) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                partial_restore=partial)
