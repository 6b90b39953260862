"""The training loop: set up the mesh and state, resume or restore, step, log, checkpoint.

Metrics stay on device between logging and checkpoint steps; there the pending
values are fetched at once and checked, so the loop does not wait on the
device in between, and no checkpoint is written after a non-finite loss or
parameter norm.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np

from mintrain import checkpoint as ckpt_lib
from mintrain import config as config_lib
from mintrain import flops, hardware, memory, metrics, report, train_state
from mintrain import mesh as mesh_lib
from mintrain.data import pipeline, tokenizer
from mintrain.data.batches import GlobalBatches, make_batches
from mintrain.metrics import NonFiniteLossError
from mintrain.optimizer import schedule
from mintrain.partitioning import AxisRules
from mintrain.train_step import make_eval_step, make_train_step

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass
class RunResult:
  records: list[dict]  # What was logged (train, eval and baseline records), in order.
  losses: list[float]  # Loss of every step this run took, in order.
  state: train_state.TrainState
  first_step: int  # Steps already taken when this run started (resume or restore).
  stopped_by: str | None = None  # Name of the signal that stopped the run early.
  summary: dict = dataclasses.field(default_factory=dict)  # The final summary's figures.


class StopSignals:
  """Turns SIGTERM/SIGINT into a flag the loop checks after each step."""

  def __init__(self):
    self.received: str | None = None
    self._previous = {}

  def __enter__(self) -> StopSignals:
    try:
      for sig in STOP_SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    except ValueError:  # Not the main thread: leave signals alone.
      self._previous = {}
    return self

  def _handle(self, signum, frame) -> None:
    self.received = signal.Signals(signum).name

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def to_host(tree):
  """Host values of replicated arrays. In a multi-process run no process can address every copy,
  so each reads its own."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(x.addressable_data(0))
    return np.asarray(x)
  return jax.tree.map(one, tree)


def checkpoint_metadata(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, step: int) -> dict:
  return {'step': step, 'config': json.loads(config.to_json_best_effort()),
          'mesh': {k: int(v) for k, v in mesh.shape.items()}, 'process_count': jax.process_count(),
          'versions': ckpt_lib.versions()}


def _check_finite(first_step: int, fetched: list[dict]) -> None:
  for i, m in enumerate(fetched):
    bad = [k for k in ('loss', 'grad_norm', 'param_norm') if not math.isfinite(float(m[k]))]
    if bad:
      values = ', '.join(f'{k}={float(m[k])}' for k in bad)
      raise NonFiniteLossError(
          f'Non-finite {values} at step {first_step + i + 1}: training stopped; the newest checkpoint '
          'is from before it. Lower optimizer.learning_rate, enable optimizer.grad_clip_norm, or check '
          'the data.')


def initial_state(config, setup: train_state.Setup, checkpoints: ckpt_lib.Checkpoints | None, *,
                  restore_from: str | None, params_only: bool, print_fn: Callable[[str], None]):
  """(state, data_state): resumed from this run, restored from another, or freshly initialised."""
  fallback = config.checkpoint.fallback_to_previous
  if checkpoints is not None and checkpoints.steps():
    step, (tree, data_state, meta) = checkpoints.restore_newest(
        setup.abstract_state, params_only=False, fallback=fallback, warn=print_fn)
    print_fn(f'Resuming from step {step} ({checkpoints.step_dir(step)}), saved on mesh '
             f'{_mesh_str(meta)}.' + (' Ignoring --restore_from: this run has its own checkpoints.'
                                      if restore_from else ''))
    return train_state.TrainState(**tree), data_state
  state = setup.init()
  if restore_from is None:
    return state, {}
  directory, step = ckpt_lib.find_run_checkpoints(restore_from)
  source = ckpt_lib.Checkpoints(directory, read_only=True)
  if step is None:
    step, (tree, data_state, meta) = source.restore_newest(
        setup.abstract_state, params_only=params_only, fallback=fallback, warn=print_fn)
  else:
    if step not in source.steps():
      raise ckpt_lib.CheckpointError(f'{restore_from}: step {step} is not a complete checkpoint.')
    tree, data_state, meta = source.restore(step, setup.abstract_state, params_only=params_only)
  source.close()
  what = 'parameters' if params_only else 'state'
  print_fn(f'Restored {what} of step {step} from {directory / str(step)} (saved on mesh {_mesh_str(meta)}).')
  if params_only:
    return state.replace(params=tree['params']), {}
  return train_state.TrainState(**tree), data_state


def evaluate(eval_step, params, batches: GlobalBatches, start_state: dict, steps: int,
             config: ml_collections.ConfigDict) -> dict[str, float]:
  """Mean loss on the first `steps` held-out batches (the same ones every time), and what follows from it."""
  batches.set_state(start_state)
  losses = [eval_step(params, next(batches)) for _ in range(steps)]
  loss = float(sum(to_host(losses)) / steps)
  out = {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 700.0))}
  if config.model.name == 'transformer':
    out['eval_bits_per_byte'] = tokenizer.bits_per_byte(loss)
  return out


def _mesh_str(meta: dict) -> str:
  return mesh_lib.describe(meta.get('mesh', {})) or 'unknown'


class Timer:
  """Wall time of logging intervals, with evaluation, saving and profiling left out."""

  def __init__(self):
    self.steps, self.seconds, self.all_steps, self.all_seconds = 0, 0.0, 0, 0.0
    self._since = time.perf_counter()

  def resume(self) -> None:
    self._since = time.perf_counter()

  def step(self) -> None:
    self.steps += 1

  def pause(self) -> None:
    self.seconds += time.perf_counter() - self._since

  def take(self) -> tuple[int, float]:
    """Pauses, and returns the steps and seconds since the last take."""
    self.pause()
    out = (self.steps, self.seconds)
    self.all_steps, self.all_seconds = self.all_steps + self.steps, self.all_seconds + self.seconds
    self.steps, self.seconds = 0, 0.0
    return out


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None, *,
        devices: Sequence[jax.Device] | None = None, restore_from: str | None = None,
        restore_params_only: bool = False, print_fn: Callable[[str], None] = print) -> RunResult:
  """Trains `config` up to `config.train.steps` steps on a mesh over `devices`."""
  run_start = time.perf_counter()
  config_lib.validate(config)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  rules = AxisRules.from_config(config.partitioning)
  setup = train_state.setup(config, rules, mesh)
  plan = memory.plan(config, rules, mesh, setup.layout, setup.abstract_state)
  is_main = jax.process_index() == 0
  say = print_fn if is_main else (lambda _: None)
  say(report.format_report(setup.layout, setup.abstract_state, mesh, plan))
  if not plan.fits:
    say(f'warning: the memory plan ({report.fmt_bytes(plan.total)}) exceeds the device memory '
        f'({report.fmt_bytes(plan.device_limit)}); lower train.global_batch_size, raise '
        'train.grad_accum_steps, or shard more (mesh.fsdp, mesh.model).')
  total, log_every, eval_every = config.train.steps, config.train.log_every, config.eval.every_steps
  flops_per_step = flops.train_flops_per_step(config)
  tokens_per_step = flops.tokens_per_step(config)
  peak, peak_source = hardware.peak_tflops(mesh.devices.flat[0], config.model.compute_dtype,
                                           config.metrics.peak_tflops)
  say(f'model: {flops.param_count(config):,} parameters, {flops_per_step / 1e9:.3f} GFLOP per step '
      f'({flops_per_step / tokens_per_step / 1e6:.3f} MFLOP per token); peak {peak:.3f} TFLOP/s per '
      f'device ({peak_source})')
  writer = metrics.make_writer(workdir, is_main=is_main, total_steps=total, print_fn=print_fn)
  writer.write_hparams(metrics.flat_hparams(config.to_dict()))
  checkpoints = None
  if workdir is not None and config.checkpoint.keep > 0:
    checkpoints = ckpt_lib.Checkpoints(pathlib.Path(workdir) / ckpt_lib.CHECKPOINTS,
                                       every_steps=config.checkpoint.every_steps, keep=config.checkpoint.keep)
  profile = Profile(config.profile, workdir, say)

  with jax.set_mesh(mesh):
    batches = make_batches(config, mesh, rules)
    eval_batches = make_batches(config, mesh, rules, split='eval')
    eval_start = eval_batches.get_state()
    state, data_state = initial_state(config, setup, checkpoints, restore_from=restore_from,
                                      params_only=restore_params_only, print_fn=say)
    if data_state.get('source') == config.data.source:
      batches.set_state(data_state)
    elif data_state:
      say(f"note: the checkpoint's data position is for data.source={data_state.get('source')!r}; "
          f'starting data.source={config.data.source!r} from its beginning.')
    first_step = int(to_host(state.step))
    records, losses, pending = [], [], []

    def log(step: int, scalars: dict[str, float]) -> None:
      records.append({'step': step, **scalars})
      writer.write_scalars(step, scalars)

    if config.data.source != 'synthetic' and is_main:  # A full pass over the eval split: once.
      log(first_step, {'unigram_bits_per_byte': pipeline.unigram_bits_per_byte(config.data)})

    train_step = make_train_step(setup.graphdef, setup.tx, schedule(config.optimizer, total),
                                 use_dropout=config.model.dropout_rate > 0)
    eval_step = make_eval_step(setup.graphdef)
    compile_time, last_eval = 0.0, {}
    timer, data_wait = Timer(), 0.0
    with StopSignals() as stop:
      for step in range(first_step, total):
        done = step + 1
        profile.before(done)
        wait_start = time.perf_counter()
        batch = next(batches)
        data_wait += time.perf_counter() - wait_start
        if step == first_step:  # Compile ahead, so its time is reported apart from the steps'.
          compile_start = time.perf_counter()
          train_step = train_step.lower(state, batch).compile()
          compile_time = time.perf_counter() - compile_start
          say(f'compiled the train step in {compile_time:.1f} s')
        state, step_metrics = train_step(state, batch)
        pending.append(step_metrics)
        if step == first_step:  # The first step's time is left out of the rates.
          jax.block_until_ready(step_metrics)
          timer, data_wait = Timer(), 0.0
        else:
          timer.step()
        stopping = stop.received is not None  # Decided once, so a stop always comes with its save.
        save = checkpoints is not None and (checkpoints.should_save(done) or done == total or stopping)
        log_now = done % log_every == 0 or done == total
        eval_now = done == total or (eval_every and done % eval_every == 0)
        if not (save or log_now or eval_now or stopping or profile.ends_at(done)):
          continue
        fetched = to_host(pending)
        _check_finite(done - len(fetched), fetched)
        losses += [float(m['loss']) for m in fetched]
        pending = []
        steps, seconds = timer.take()
        profile.after(done)
        if save:
          checkpoints.save(done, state, data_state=batches.get_state(),
                           metadata=checkpoint_metadata(config, mesh, done))
        if log_now:
          scalars = {k: float(v) for k, v in fetched[-1].items()}
          if steps:
            scalars.update(metrics.throughput(steps, seconds, tokens_per_step=tokens_per_step,
                                              flops_per_step=flops_per_step, num_devices=mesh.size,
                                              peak_tflops=peak))
            scalars['data_wait_fraction'] = min(data_wait / seconds, 1.0)
            scalars['eta_sec'] = (total - done) * scalars['step_time']
          data_wait = 0.0
          log(done, scalars)
        if eval_now:
          last_eval = evaluate(eval_step, state.params, eval_batches, eval_start, config.eval.steps, config)
          log(done, last_eval)
        timer.resume()
        if stopping:
          break
    if checkpoints is not None:
      checkpoints.wait()
      checkpoints.close()
    profile.close()

  last_step = int(to_host(state.step))
  stopped_by = stop.received if last_step < total else None
  if stopped_by:
    where = (f'saved step {last_step} to {checkpoints.step_dir(last_step)}' if checkpoints
             else 'no workdir, nothing saved')
    say(f'Received {stopped_by}: finished step {last_step}, {where}; exiting.')
  summary = {'total_time_sec': time.perf_counter() - run_start, 'compile_time_sec': compile_time}
  if timer.all_steps:
    summary.update(metrics.throughput(timer.all_steps, timer.all_seconds, tokens_per_step=tokens_per_step,
                                      flops_per_step=flops_per_step, num_devices=mesh.size, peak_tflops=peak))
  if losses:
    summary['final_loss'] = losses[-1]
  summary.update({f'final_{k}': v for k, v in last_eval.items()})
  if losses:
    say(metrics.format_summary(summary))
  writer.flush()
  writer.close()
  return RunResult(records, losses, state, first_step, stopped_by, summary)


class Profile:
  """A JAX profiler trace of steps start_step .. start_step + num_steps - 1 into WORKDIR/profile."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str | pathlib.Path | None,
               say: Callable[[str], None]):
    self.start, self.count, self.say = cfg.start_step, cfg.num_steps, say
    self.directory = pathlib.Path(workdir or '.') / 'profile'
    self.active = False

  def before(self, step: int) -> None:
    if self.start > 0 and step == self.start:
      jax.profiler.start_trace(str(self.directory))
      self.active = True

  def ends_at(self, step: int) -> bool:
    return self.active and step >= self.start + self.count - 1

  def after(self, step: int) -> None:
    if self.ends_at(step):
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      self.say(f'profile: steps {self.start}..{self.start + self.count - 1} written to {self.directory} '
               f'(open with TensorBoard\'s profile plugin or https://ui.perfetto.dev)')
