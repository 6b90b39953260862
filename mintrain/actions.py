"""The loop's periodic actions (Levanter's hooks): each says when it is `due` after a step and owns its
timing and, as a context in the run's `ExitStack`, its cleanup on every exit path."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from mintrain import lora, metric_writers, metrics, report
from mintrain.build import Run
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.data import streaming, tokenizer
from mintrain.data.batches import GlobalBatches
from mintrain.errors import ConfigError, StorageError
from mintrain.fields import option
from mintrain.runtime import host_allocator
from mintrain.runtime.storage import is_remote, os_reason
from mintrain.train_state import TrainState

Say = Callable[[str], None]
LogFn = Callable[[int, dict], None]


def _task_list(value: str) -> str | None:
  names = value.split(',')
  if value and any(not name.strip() or name != name.strip() for name in names):
    return 'must be lm-eval task names separated by commas, with no spaces or empty names ("arc_easy,piqa")'
  return None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int = option(at_least=0)
  steps: int = option(at_least=0)  # 0: no evaluation.
  harness_tasks: str = option(check=_task_list)  # '': no lm-eval tasks.
  harness_every_steps: int = option(at_least=0)
  harness_limit: float = option(at_least=0)  # 0: every document.
  harness_include_path: str = option()


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  start_step: int = option(at_least=-1)
  num_steps: int = option(at_least=1)


def to_host(tree):
  """Host values of a tree of arrays: a replicated one from this process's own copy, one split over
  processes gathered from all (every process must call it)."""
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)


class RunLog(logging.Handler):
  """For a run's duration, the libraries' log records (Orbax through absl, asyncio: e.g. the tracebacks of a
  save that ran out of disk, which mintrain's DiskFullError says in one line), mintrain's own details (the
  traceback of a damaged checkpoint's read) and the exceptions Python reports as unraisable (Orbax's read
  coroutines after a damaged checkpoint) go to WORKDIR/logs/run.log, not the console, which keeps
  mintrain's one line. Held in memory until the run may write (`open`); for a remote workdir, copied there
  when the run ends."""

  LOGGERS = ('absl', 'asyncio', 'mintrain.details')

  def __init__(self, workdir: epath.Path | None):
    super().__init__(logging.DEBUG)
    self.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s %(pathname)s:%(lineno)d] '
                                        '%(message)s'))
    index = jax.process_index()
    self.name = 'run.log' if index == 0 else f'run.{index}.log'
    # A remote workdir's log is written to a local stand-in and copied there whole at the end.
    self.remote = workdir / 'logs' if workdir is not None and is_remote(workdir) else None
    self.path = workdir / 'logs' / self.name if workdir is not None and self.remote is None else None
    self.staging: metric_writers.Staging | None = None
    self.pending: list[str] = []
    self.file, self.opened = None, False

  def emit(self, record: logging.LogRecord) -> None:
    self.write(self.format(record))

  def unraisable(self, u: sys.UnraisableHookArgs) -> None:
    where = f'{u.err_msg or "Exception ignored in"}: {u.object!r}\n' if u.object is not None else ''
    self.write(where + ''.join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))

  def write(self, text: str) -> None:
    if not self.opened:
      self.pending.append(text)
    elif self.path is not None or self.remote is not None:
      # A full disk or an unreachable bucket loses these details, never the run's own error.
      with contextlib.suppress(OSError, StorageError):
        if self.file is None:  # Made on the first record: a quiet run leaves no log file.
          if self.remote is not None:
            self.staging = metric_writers.Staging(self.remote, fetch=(self.name,))
            self.path = epath.Path(self.staging.local) / self.name
          self.path.parent.mkdir(parents=True, exist_ok=True)
          self.file = open(self.path, 'a')  # Closed by __exit__.
        self.file.write(text.rstrip('\n') + '\n')
        self.file.flush()

  def open(self) -> None:
    """Writes what was held and everything after to the file (nothing without a local workdir)."""
    self.opened = True
    for text in self.pending:
      self.write(text)
    self.pending = []

  def __enter__(self) -> RunLog:
    self.saved = [(logging.getLogger(name), logging.getLogger(name).propagate) for name in self.LOGGERS]
    for logger, _ in self.saved:
      logger.addHandler(self)
      logger.propagate = False
    self.hook, sys.unraisablehook = sys.unraisablehook, self.unraisable
    return self

  def __exit__(self, *exc) -> None:
    sys.unraisablehook = self.hook
    for logger, propagate in self.saved:
      logger.removeHandler(self)
      logger.propagate = propagate
    if self.file is not None:
      with contextlib.suppress(OSError):
        self.file.close()
    if self.staging is not None:
      with contextlib.suppress(OSError, StorageError):
        self.staging.close()
    self.close()


class Timer:
  """Wall time of the steps between logging records, with the actions' own time left out."""

  def __init__(self):
    self.phases: dict[str, float] = {}
    self.restart()

  def restart(self) -> None:  # The first step, with its compilation, is left out of the rates.
    self.steps, self.seconds, self.all_steps, self.all_seconds, self.data_wait = 0, 0.0, 0, 0.0, 0.0
    self._since = time.perf_counter()

  def spend(self, phase: str, seconds: float) -> None:
    """Wall time outside the steps, by what it went to (goodput's split: data wait, checkpointing, ...)."""
    self.phases[phase] = self.phases.get(phase, 0.0) + seconds

  def resume(self) -> None:
    self._since = time.perf_counter()

  def pause(self) -> None:
    self.seconds += time.perf_counter() - self._since

  def take(self) -> tuple[int, float, float]:  # (steps, seconds, seconds waiting for data) since the last.
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

  phase = 'logging'  # Where its time goes in the run's time split.

  def __init__(self, run: Run, timer: Timer, log: LogFn, peak: float):
    self.every, self.total = run.config.train.log_every, run.config.train.steps
    self.timer, self.log, self.peak = timer, log, peak
    self.data, self.seed, self.rows = run.config.data, run.config.seed, run.config.train.global_batch_size
    self.rates = dict(tokens_per_step=report.tokens_per_step(run.config),
                      flops_per_step=report.train_flops_per_step(run.config), num_devices=run.mesh.size)
    self.pipeline = run.placement.pipeline

  def due(self, info: StepInfo) -> bool:
    return info.step % self.every == 0 or info.last

  def __call__(self, info: StepInfo) -> None:
    scalars = {k: float(v) for k, v in info.metrics[-1].items()}
    steps, seconds, data_wait = self.timer.take()
    if steps:
      scalars.update(metrics.throughput(steps, seconds, **self.rates, peak_tflops=self.peak))
      scalars['data_wait_fraction'] = min(data_wait / seconds, 1.0)
      scalars['eta_sec'] = (self.total - info.step) * scalars['step_time']
    if self.pipeline.stages > 1:  # The schedule's idle share, beside the measured step time.
      scalars['pipeline_bubble'] = self.pipeline.bubble
    if self.data.source == 'mixture':  # Each source's share of the tokens of the last `every` steps.
      steps = range(max(info.step - self.every, 0), info.step)
      scalars.update(streaming.token_fractions(self.data, self.seed, self.rows, steps))
    self.log(info.step, scalars)


class Evaluate:
  """Every `eval.every_steps` steps and at the end: mean loss on the same held-out batches each time. Batches
  that hold no trained token (every conversation cut to its prompt) have no mean: that is said once, and
  nothing is logged."""

  phase = 'evaluation'  # Where its time goes in the run's time split.

  def __init__(self, run: Run, log: LogFn, batches: GlobalBatches | None, bytes_per_token: float | None,
               say: Say):
    self.run, self.log, self.say, self.every = run, log, say, run.config.eval.every_steps
    self.batches, self.bytes_per_token = batches, bytes_per_token
    self.start = self.batches.get_state() if self.batches is not None else {}
    self.last: dict[str, float] = {}
    self.said_empty = False

  def due(self, info: StepInfo) -> bool:
    if not self.run.config.eval.steps:
      return False
    return info.last or bool(self.every and info.step % self.every == 0)

  def __call__(self, info: StepInfo) -> None:
    self.last = evaluate(self.run, info.state.params, self.batches, self.start, self.bytes_per_token,
                         frozen=info.state.frozen, reference=info.state.reference)
    if self.last:
      self.log(info.step, self.last)
    elif not self.said_empty:
      self.said_empty = True
      self.say(f'eval: the held-out batches (eval.steps={self.run.config.eval.steps}) hold no trained token '
               '(each conversation cut to its prompt?): no eval loss is logged; raise train.seq_len or '
               'eval.steps.')


def evaluate(run: Run, params, batches: GlobalBatches, start_state: dict,
             bytes_per_token: float | None = None, frozen=None, reference=None) -> dict[str, float]:
  """Mean loss over the counted targets of the first `eval.steps` held-out batches (the same ones every
  time), perplexity, the family's own figures, and bits per byte where bytes per token are known; {} when
  they count no target."""
  steps = run.config.eval.steps
  batches.set_state(start_state)
  sums, counts = zip(*to_host([run.eval_step(params, next(batches), frozen, reference)
                               for _ in range(steps)]))
  if not sum(counts):
    return {}
  loss = float(sum(sums) / sum(counts))
  out = {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 700.0))}
  if bytes_per_token:
    out['eval_bits_per_byte'] = loss / math.log(2) / bytes_per_token
  return out | run.config.model.eval_metrics(loss)


class HarnessEvaluate:
  """Every `eval.harness_every_steps` steps and at the end: lm-evaluation-harness tasks on the live
  parameters (no checkpoint round trip), each task's metrics logged as `harness/<task>/<metric>`. The task
  names are checked when it is built, before the run writes anything."""

  phase = 'evaluation'  # Where its time goes in the run's time split.

  def __init__(self, run: Run, log: LogFn, tok: tokenizer.Tokenizer, say: Say):
    from mintrain.evaluation import harness  # lm-eval (the `eval` extra) only when asked for.

    cfg = run.config.eval
    self.run, self.log, self.tok, self.say, self.harness = run, log, tok, say, harness
    self.every, self.tasks = cfg.harness_every_steps, cfg.harness_tasks.split(',')
    self.limit = (int(cfg.harness_limit) if cfg.harness_limit >= 1 else cfg.harness_limit) or None
    if run.config.model.vocab_size is None:
      raise ConfigError(f'eval.harness_tasks={cfg.harness_tasks!r} needs a language model; '
                        f'model.name={run.config.model_name!r} reads no token ids.')
    self.manager = harness.task_manager(cfg.harness_include_path)
    harness.check_tasks(self.tasks, self.manager, 'eval.harness_tasks')

  def due(self, info: StepInfo) -> bool:
    return info.last or bool(self.every and info.step % self.every == 0)

  def __call__(self, info: StepInfo) -> None:
    config = self.run.config
    lm = self.harness.HarnessLM(self.run.model(info.state.params), config, self.tok, self.run.mesh,
                                batch_size=config.train.micro_batch_size, max_length=config.train.seq_len)
    scalars = self.harness.scalars(self.harness.evaluate(lm, self.tasks, self.manager, limit=self.limit,
                                                         bootstrap_iters=0))
    self.say(f'step {info.step} lm-eval: ' + ', '.join(f'{k.removeprefix("harness/")} {v:.4g}'
                                                      for k, v in scalars.items()))
    self.log(info.step, scalars)


def checkpoint_metadata(run: Run, step: int) -> dict:
  """What a checkpoint records beside the arrays: the config, the mesh and the versions that saved it, and
  for LoRA on a Hugging Face base, where that base is and its fingerprint (a resume reads it from there)."""
  out = {'step': step, 'config': run.config.to_dict(),
         'mesh': {k: int(v) for k, v in run.mesh.shape.items()},
         'process_count': jax.process_count(), 'versions': ckpt_lib.versions()}
  if run.config.lora.enabled and run.config.init.hf_checkpoint:
    out['lora_base'] = lora.base_fingerprint(run.config.init.hf_checkpoint)
  return out


class Save:
  """A checkpoint every `checkpoint.every_steps` steps, at the end and on a stop (this action decides, not
  Orbax). On exit it finishes the save in flight, or after a failure abandons it rather than hide the
  failure. Each save hands the host heap's free pages back, so the RSS stays where the first left it."""

  phase = 'checkpointing'  # Where its time goes in the run's time split.

  def __init__(self, run: Run, checkpoints: ckpt_lib.Checkpoints, batches: GlobalBatches):
    self.run, self.checkpoints, self.batches = run, checkpoints, batches
    self.every = run.config.checkpoint.every_steps

  def due(self, info: StepInfo) -> bool:
    # A periodic save never replaces a saved step (a damaged one fallen back from is moved aside first).
    periodic = self.every > 0 and info.step % self.every == 0 and info.step > self.checkpoints.newest_step()
    return periodic or info.last or info.stopping

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
  """A JAX profiler trace of steps start_step .. start_step + num_steps - 1 into WORKDIR/profile (staged
  locally for a remote workdir), closed on exit; none without a workdir."""

  phase = 'profiling'  # Where its time goes in the run's time split.

  def __init__(self, cfg: ProfileConfig, workdir: epath.Path | None, say: Say):
    self.start, self.count, self.say = cfg.start_step, cfg.num_steps, say
    if workdir is None and self.start > 0:
      say('note: profile.start_step is set but there is no workdir: no profile is written.')
      self.start = 0
    self.directory = None if workdir is None else workdir / 'profile'
    self.staging: metric_writers.Staging | None = None
    self.active = False

  def before(self, step: int) -> None:
    if self.start > 0 and step == self.start:
      self.staging = metric_writers.Staging(self.directory)
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


SHARDING_REPORT = 'sharding.txt'  # WORKDIR/sharding.txt: every parameter's shape, axes and layout.


class Actions:
  """A run's actions in the order they run (a save first). The metrics writer is opened by `start_writing`,
  once the restore has passed its checks, so a refused run writes nothing."""

  def __init__(self, stack: contextlib.ExitStack, run: Run, workdir: epath.Path | None, timer: Timer,
               peak: float, batches: GlobalBatches, eval_batches: GlobalBatches | None,
               bytes_per_token: float | None, *, is_main: bool, say: Say, console: metrics.Console,
               tok: tokenizer.Tokenizer | None = None):
    config = run.config
    self.stack, self.config, self.workdir, self.run = stack, config, workdir, run
    self.is_main, self.console = is_main, console
    self.records: list[dict] = []
    self.writer: metric_writers.MultiWriter | None = None
    self.checkpoints, save = None, []
    if workdir is not None and config.checkpoint.keep > 0:
      self.checkpoints = ckpt_lib.Checkpoints(workdir / ckpt_lib.CHECKPOINTS, keep=config.checkpoint.keep)
      save = [stack.enter_context(Save(run, self.checkpoints, batches))]
    self.profile = stack.enter_context(Profile(config.profile, workdir, say))
    self.evaluation = Evaluate(run, self.log, eval_batches, bytes_per_token, say)
    harness = [HarnessEvaluate(run, self.log, tok, say)] if config.eval.harness_tasks else []
    self.all: list = [*save, Log(run, timer, self.log, peak), self.evaluation, *harness, self.profile]

  def start_writing(self) -> None:
    """Opens the metrics writer (closed by the stack, keeping an error already on its way out over its own)
    and writes the hyperparameters."""
    run = self.run
    sharding = report.format_report(run.layout, run.abstract_state, run.mesh, run.plan, run.rules)
    if self.is_main and self.workdir is not None:  # The console had the summary; the table goes here.
      path = self.workdir / SHARDING_REPORT
      try:
        path.write_text(sharding + '\n')
      except OSError as e:
        raise StorageError(f'Writing {path} failed ({os_reason(e)}).') from e
      self.console.line(f'sharding: one row per parameter in {path}')
    metadata = {'sharding_report': sharding, 'memory_plan_bytes_per_device': dataclasses.asdict(run.plan)}
    self.writer = self.stack.enter_context(metric_writers.make_writer(
        self.workdir, is_main=self.is_main, total_steps=self.config.train.steps, console=self.console,
        cfg=self.config.metrics, metadata=metadata))
    self.writer.write_hparams(metric_writers.flat_hparams(self.config.to_dict()))

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self.records.append({'step': step, **scalars})
    self.writer.write_scalars(step, scalars)

  def due(self, info: StepInfo) -> list:
    return [action for action in self.all if action.due(info)]
