"""The training loop: build the run, start it (resume, restore or the seed), then step, with small
periodic actions that log, evaluate, save and profile, each owning its timing (Levanter's hooks).

Metrics stay on device between the steps where some action is due; there, every pending step's
values are fetched at once and checked (the finite check), before anything is saved, so no
checkpoint follows a non-finite loss. The writers, the checkpoint manager, the profiler and the
signal handlers are entered in one `ExitStack`: on every exit path (the end, a stop signal, a
non-finite loss, an exception anywhere) the asynchronous save in flight is finished (or abandoned
if it failed), the profiler trace is closed and the metrics are flushed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from etils import epath

from mintrain import config as config_lib
from mintrain import errors, metrics, report
from mintrain.build import Run, build
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.config import Config, ProfileConfig
from mintrain.data import pipeline, streaming, tokenizer
from mintrain.data.batches import GlobalBatches
from mintrain.errors import NonFiniteLossError
from mintrain.runtime import distributed, hardware, host_allocator, preemption, storage
from mintrain.runtime.run_lock import RunLock
from mintrain.train_state import TrainState

Say = Callable[[str], None]


@dataclasses.dataclass
class RunResult:
  records: list[dict]  # What was logged (train, eval and baseline records), in order.
  losses: list[float]  # Loss of every step this run took, in order.
  state: TrainState
  first_step: int  # Steps already taken when this run started (resume or restore).
  stopped_by: str | None = None  # What stopped the run early: a signal's name or an agreed request.
  summary: dict = dataclasses.field(default_factory=dict)  # The final summary's figures.


def to_host(tree):
  """Host values of replicated arrays. In a multi-process run no process can address every copy,
  so each reads its own."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(x.addressable_data(0))
    return np.asarray(x)
  return jax.tree.map(one, tree)


def check_finite(first_step: int, fetched: list[dict]) -> None:
  """The finite check: raises naming the first step whose loss or norms are NaN or infinite."""
  for i, m in enumerate(fetched):
    bad = [k for k in ('loss', 'grad_norm', 'param_norm') if not math.isfinite(float(m[k]))]
    if bad:
      values = ', '.join(f'{k}={float(m[k])}' for k in bad)
      raise NonFiniteLossError(
          f'Non-finite {values} at step {first_step + i + 1}: training stopped; the newest checkpoint '
          'is from before it. Lower optimizer.learning_rate, enable optimizer.grad_clip_norm, or check '
          'the data.')


class Timer:
  """Wall time of the steps between logging records, with the actions' own time left out."""

  def __init__(self):
    self.restart()

  def restart(self) -> None:
    """Forget everything so far (the first step, with its compilation, is left out of the rates)."""
    self.steps, self.seconds, self.all_steps, self.all_seconds = 0, 0.0, 0, 0.0
    self.data_wait = 0.0
    self._since = time.perf_counter()

  def resume(self) -> None:
    self._since = time.perf_counter()

  def pause(self) -> None:
    self.seconds += time.perf_counter() - self._since

  def take(self) -> tuple[int, float, float]:
    """(steps, seconds, seconds waiting for data) since the last take."""
    out = (self.steps, self.seconds, self.data_wait)
    self.all_steps, self.all_seconds = self.all_steps + self.steps, self.all_seconds + self.seconds
    self.steps, self.seconds, self.data_wait = 0, 0.0, 0.0
    return out


@dataclasses.dataclass
class StepInfo:
  """What the actions see after a step."""

  step: int  # Steps done, this one included.
  last: bool  # The run's final step.
  stopping: bool  # A stop was requested: this step is the last, and it is saved.
  state: TrainState
  metrics: list[dict] = dataclasses.field(default_factory=list)  # Host values of the steps since the last.


class Log:
  """Every `train.log_every` steps and at the end: the step's metrics and the interval's throughput."""

  def __init__(self, run: Run, timer: Timer, log: Callable[[int, dict], None], peak: float):
    self.every, self.total = run.config.train.log_every, run.config.train.steps
    self.timer, self.log, self.peak = timer, log, peak
    self.data, self.seed, self.rows = run.config.data, run.config.seed, run.config.train.global_batch_size
    self.rates = dict(tokens_per_step=report.tokens_per_step(run.config),
                      flops_per_step=report.train_flops_per_step(run.config), num_devices=run.mesh.size)

  def due(self, info: StepInfo) -> bool:
    return info.step % self.every == 0 or info.last

  def __call__(self, info: StepInfo) -> None:
    scalars = {k: float(v) for k, v in info.metrics[-1].items()}
    steps, seconds, data_wait = self.timer.take()
    if steps:
      scalars.update(metrics.throughput(steps, seconds, **self.rates, peak_tflops=self.peak))
      scalars['data_wait_fraction'] = min(data_wait / seconds, 1.0)
      scalars['eta_sec'] = (self.total - info.step) * scalars['step_time']
    if self.data.source == 'mixture':  # Each source's share of the tokens of the last `every` steps.
      steps = range(max(info.step - self.every, 0), info.step)
      scalars.update(streaming.token_fractions(self.data, self.seed, self.rows, steps))
    self.log(info.step, scalars)


class Evaluate:
  """Every `eval.every_steps` steps and at the end: mean loss on the same held-out batches each time."""

  def __init__(self, run: Run, log: Callable[[int, dict], None], batches: GlobalBatches | None,
               bytes_per_token: float | None):
    self.run, self.log, self.every = run, log, run.config.eval.every_steps
    self.batches, self.bytes_per_token = batches, bytes_per_token
    self.start = self.batches.get_state() if self.batches is not None else {}
    self.last: dict[str, float] = {}

  def due(self, info: StepInfo) -> bool:
    if not self.run.config.eval.steps:
      return False
    return info.last or bool(self.every and info.step % self.every == 0)

  def __call__(self, info: StepInfo) -> None:
    self.last = evaluate(self.run, info.state.params, self.batches, self.start, self.bytes_per_token)
    self.log(info.step, self.last)


def evaluate(run: Run, params, batches: GlobalBatches, start_state: dict,
             bytes_per_token: float | None = None) -> dict[str, float]:
  """Mean loss over the counted targets of the first `eval.steps` held-out batches (the same ones every
  time), and what follows: perplexity, the family's own figures, and bits per byte where the text's bytes
  per token are known."""
  steps = run.config.eval.steps
  batches.set_state(start_state)
  sums, counts = zip(*to_host([run.eval_step(params, next(batches)) for _ in range(steps)]))
  loss = float(sum(sums) / sum(counts))
  out = {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 700.0))}
  if bytes_per_token:
    out['eval_bits_per_byte'] = loss / math.log(2) / bytes_per_token
  return out | run.config.model.eval_metrics(loss)


def checkpoint_metadata(run: Run, step: int) -> dict:
  """What a checkpoint records beside the arrays: the config, the mesh and the versions that saved it."""
  return {'step': step, 'config': run.config.to_dict(),
          'mesh': {k: int(v) for k, v in run.mesh.shape.items()},
          'process_count': jax.process_count(), 'versions': ckpt_lib.versions()}


class Save:
  """A checkpoint every `checkpoint.every_steps` steps, at the end and on a stop. As a context, it
  finishes the save in flight on exit; after a failure it abandons it rather than hide the failure.
  Each save then hands the host heap's free pages back (`host_allocator.release_freed_memory`), so the
  RSS after a save stays where it was after the first."""

  def __init__(self, run: Run, checkpoints: ckpt_lib.Checkpoints, batches: GlobalBatches):
    self.run, self.checkpoints, self.batches = run, checkpoints, batches

  def due(self, info: StepInfo) -> bool:
    return self.checkpoints.should_save(info.step) or info.last or info.stopping

  def __call__(self, info: StepInfo) -> None:
    self.checkpoints.save(info.step, info.state, data_state=self.batches.get_state(),
                          metadata=checkpoint_metadata(self.run, info.step))
    host_allocator.release_freed_memory()

  def __enter__(self) -> Save:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.checkpoints.wait()
      self.checkpoints.close()
      return
    with contextlib.suppress(Exception):  # The error already on its way out is the one to report.
      self.checkpoints.close()


class Profile:
  """A JAX profiler trace of steps start_step .. start_step + num_steps - 1 into WORKDIR/profile; as a
  context, it closes a trace still open on exit. The profiler writes local files: for a remote workdir
  it traces into a local `metrics.Staging` directory, copied to WORKDIR/profile when the trace closes."""

  def __init__(self, cfg: ProfileConfig, workdir: epath.Path | None, say: Say):
    self.start, self.count, self.say = cfg.start_step, cfg.num_steps, say
    self.directory = (workdir or epath.Path('.')) / 'profile'
    self.staging: metrics.Staging | None = None
    self.active = False

  def before(self, step: int) -> None:
    if self.start > 0 and step == self.start:
      self.staging = metrics.Staging(self.directory)
      jax.profiler.start_trace(str(self.staging.local))
      self.active = True

  def due(self, info: StepInfo) -> bool:
    return self.active and info.step >= self.start + self.count - 1

  def __call__(self, info: StepInfo) -> None:
    self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      self.staging.close()
      self.say(f'profile: steps {self.start}..{self.start + self.count - 1} written to {self.directory} '
               f'(open with TensorBoard\'s profile plugin or https://ui.perfetto.dev)')

  def __enter__(self) -> Profile:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def initial_state(run: Run, checkpoints: ckpt_lib.Checkpoints | None, *, restore_from: str | None,
                  params_only: bool, print_fn: Say) -> tuple[TrainState, dict]:
  """(state, data position): resumed from this run, restored from another, or drawn from the seed.

  A restore reads straight into the run's layout; only what the checkpoint lacks is initialised
  (the optimizer state and step, for `params_only`).
  """
  fallback = run.config.checkpoint.fallback_to_previous
  if checkpoints is not None and checkpoints.steps():
    restored = checkpoints.restore_newest(run.abstract_state, params_only=False, fallback=fallback,
                                          warn=print_fn)
    print_fn(f'Resuming from step {restored.step} ({checkpoints.step_dir(restored.step)}), saved on mesh '
             f'{restored.mesh}.' + (' Ignoring --restore_from: this run has its own checkpoints.'
                                    if restore_from else ''))
    changed = config_lib.differences(restored.metadata.get('config', {}), run.config.to_dict())
    if changed:
      print_fn(f"The config differs from the checkpoint's: {', '.join(changed)}.")
    return TrainState(**restored.state), restored.data
  if restore_from is None and run.config.init.hf_checkpoint:
    from mintrain import hf  # safetensors only when asked for.

    path = run.config.init.hf_checkpoint
    print_fn(f'Initialising the parameters from the Hugging Face checkpoint {path}.')
    return run.from_params(hf.load_params(path, run)), {}
  if restore_from is None:
    return run.init(), {}
  directory, step = ckpt_lib.find_run_checkpoints(restore_from)
  source = ckpt_lib.Checkpoints(directory, read_only=True)
  try:
    if step is None:
      restored = source.restore_newest(run.abstract_state, params_only=params_only, fallback=fallback,
                                       warn=print_fn)
    elif step not in source.steps():
      raise errors.CheckpointError(f'{restore_from}: step {step} is not a complete checkpoint.')
    else:
      restored = source.restore(step, run.abstract_state, params_only=params_only)
  finally:
    source.close()
  what = 'parameters' if params_only else 'state'
  print_fn(f'Restored {what} of step {restored.step} from {directory / str(restored.step)} '
           f'(saved on mesh {restored.mesh}).')
  if params_only:
    return run.from_params(restored.state['params']), {}
  return TrainState(**restored.state), restored.data


def _has_saves(workdir: epath.Path | None) -> bool:
  """Whether the workdir's checkpoint directory holds anything (a resume, which ignores init.*)."""
  directory = None if workdir is None else workdir / ckpt_lib.CHECKPOINTS
  return directory is not None and directory.exists() and any(directory.iterdir())


def run(config: Config, workdir: str | epath.Path | None, *, devices: Sequence[jax.Device] | None = None,
        restore_from: str | None = None, restore_params_only: bool = False, force: bool = False,
        print_fn: Say = print) -> RunResult:
  """Trains `config` up to `config.train.steps` steps on a mesh over `devices`.

  Process 0 holds the workdir's lock (`run_lock.RunLock`) from before anything is built or written to
  the end; `force` takes it over even from a holder that may still run.
  """
  run_start = time.perf_counter()
  is_main = jax.process_index() == 0
  say = print_fn if is_main else (lambda _: None)
  workdir = None if workdir is None else storage.prepare_dir(workdir)  # A bad one fails before the build.
  records, losses, pending = [], [], []
  timer = Timer()

  with contextlib.ExitStack() as stack:
    stop = stack.enter_context(preemption.StopRequests())  # First: a stop during the set-up is kept.
    if workdir is not None and is_main:
      stack.enter_context(RunLock(workdir, force=force, warn=say))
    r = build(config, devices)
    config = r.config
    say(report.format_report(r.layout, r.abstract_state, r.mesh, r.plan, r.rules))
    for note in r.notes:
      say(f'note: {note}')
    report.check(r.plan)
    text = config.data.source != 'synthetic'
    # Data first: unreadable data or tokenizer (a bad file, a bad line in the first blocks) stops the run
    # before it writes anything.
    with jax.set_mesh(r.mesh):
      batches = r.batches()
      eval_batches = r.batches('eval') if config.eval.steps else None
    bytes_per_token = pipeline.bytes_per_token(config.data) if text else None
    baseline = {}
    if text and is_main:  # A full pass over the eval split: once.
      bits = pipeline.unigram_bits_per_token(config.data)
      baseline = {'unigram_bits_per_token': bits, 'unigram_bits_per_byte': bits / bytes_per_token}
    if config.init.hf_checkpoint and restore_from is None and not _has_saves(workdir):
      from mintrain import hf  # safetensors only when asked for.

      hf.check(config.init.hf_checkpoint, r)  # Its tensors and shapes, before the run writes anything.
    if text and workdir is not None and is_main:  # The run's copy of its tokenizer, for sampling and export.
      tokenizer.load(config.data.tokenizer).save(workdir / tokenizer.RUN_DIR)
    total = config.train.steps
    flops_per_step, tokens_per_step = report.train_flops_per_step(config), report.tokens_per_step(config)
    peak, peak_source = hardware.peak_tflops(
        r.mesh.devices.flat[0], config.model.compute_dtype, config.metrics.peak_tflops)
    say(f'model: {report.param_count(config):,} parameters, {flops_per_step / 1e9:.3f} GFLOP per step '
        f'({flops_per_step / tokens_per_step / 1e6:.3f} MFLOP per token); peak {peak:.3f} TFLOP/s per '
        f'device ({peak_source})')
    # As a context, the writer keeps an error already on its way out (a full disk) over its own.
    writer = stack.enter_context(
        metrics.make_writer(workdir, is_main=is_main, total_steps=total, print_fn=print_fn))
    writer.write_hparams(metrics.flat_hparams(config.to_dict()))

    def log(step: int, scalars: dict[str, float]) -> None:
      records.append({'step': step, **scalars})
      writer.write_scalars(step, scalars)

    checkpoints = None
    if workdir is not None and config.checkpoint.keep > 0:
      checkpoints = ckpt_lib.Checkpoints(workdir / ckpt_lib.CHECKPOINTS,
                                         every_steps=config.checkpoint.every_steps,
                                         keep=config.checkpoint.keep)
    profile = stack.enter_context(Profile(config.profile, workdir, say))
    stack.enter_context(jax.set_mesh(r.mesh))
    evaluation = Evaluate(r, log, eval_batches, bytes_per_token)
    actions: list = [Log(r, timer, log, peak), evaluation, profile]
    if checkpoints is not None:  # It saves before the others run.
      actions.insert(0, stack.enter_context(Save(r, checkpoints, batches)))
    state, data_state = initial_state(r, checkpoints, restore_from=restore_from,
                                      params_only=restore_params_only, print_fn=say)
    if data_state.get('source') == config.data.source:
      batches.set_state(data_state)
    elif data_state:
      say(f"note: the checkpoint's data position is for data.source={data_state.get('source')!r}; "
          f'starting data.source={config.data.source!r} from its beginning.')
    first_step = int(to_host(state.step))
    if baseline:
      log(first_step, baseline)

    train_step, compile_time, stopped = r.train_step, 0.0, False
    for step in range(first_step, total):
      profile.before(step + 1)
      wait_start = time.perf_counter()
      batch = next(batches)
      timer.data_wait += time.perf_counter() - wait_start
      if step == first_step:  # Compile ahead, so its time is reported apart from the steps'.
        compile_start = time.perf_counter()
        train_step = train_step.lower(state, batch).compile()
        compile_time = time.perf_counter() - compile_start
        say(f'compiled the train step in {compile_time:.1f} s')
        distributed.barrier('mintrain: the train step is compiled')
      state, step_metrics = train_step(state, batch)
      pending.append(step_metrics)
      if step == first_step:  # The first step's time is left out of the rates.
        jax.block_until_ready(step_metrics)
        timer.restart()
      else:
        timer.steps += 1
      stopped = stop.should_stop(step + 1 - first_step)
      info = StepInfo(step + 1, last=step + 1 == total, stopping=stopped, state=state)
      due = [action for action in actions if action.due(info)]
      if not due:
        continue
      info.metrics = to_host(pending)  # Waits for the steps dispatched ahead: their time is the interval's.
      timer.pause()
      pending = []
      check_finite(step + 1 - len(info.metrics), info.metrics)
      losses += [float(m['loss']) for m in info.metrics]
      for action in due:
        action(info)
      timer.resume()
      if info.stopping:
        break

  last_step = int(to_host(state.step))
  stopped_by = stop.reason if stopped and last_step < total else None
  if stopped_by:
    where = (f'saved step {last_step} to {checkpoints.step_dir(last_step)}' if checkpoints
             else 'no workdir, nothing saved')
    cause = f'Received {stop.received}' if stop.received else f'Stopped by {stopped_by}'
    say(f'{cause}: finished step {last_step}, {where}; exiting.')
  summary = {'total_time_sec': time.perf_counter() - run_start, 'compile_time_sec': compile_time}
  if timer.all_steps:
    summary.update(metrics.throughput(timer.all_steps, timer.all_seconds, tokens_per_step=tokens_per_step,
                                      flops_per_step=flops_per_step, num_devices=r.mesh.size,
                                      peak_tflops=peak))
  if losses:
    summary['final_loss'] = losses[-1]
  summary.update({f'final_{k}': v for k, v in evaluation.last.items()})
  if losses:
    say(metrics.format_summary(summary))
  return RunResult(records, losses, state, first_step, stopped_by, summary)
