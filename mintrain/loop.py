"""The training loop: build the run, start it (resume, restore or the seed), then step. Where an action is
due, the pending steps' values are fetched and checked first, so no checkpoint follows a non-finite loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import jax
from etils import epath
from flax import nnx

from mintrain import actions as actions_lib
from mintrain import config as config_lib
from mintrain import errors, lora, metric_writers, metrics, report
from mintrain.actions import Say, StepInfo, Timer, to_host
from mintrain.build import Run, build
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.config import Config
from mintrain.data import statistics, tokenizer
from mintrain.data.batches import GlobalBatches
from mintrain.objectives.objective import Rollout
from mintrain.runtime import caches, distributed, hardware, preemption, storage
from mintrain.runtime.run_lock import RunLock
from mintrain.runtime.watchdog import Watchdog
from mintrain.train_state import TrainState


@dataclasses.dataclass
class RunResult:
  records: list[dict]  # What was logged (train, eval and baseline records), in order.
  losses: list[float]  # Loss of every step this run took, in order.
  state: TrainState
  first_step: int  # Steps already taken when this run started (resume or restore).
  stopped_by: str | None = None  # What stopped the run early: a signal's name or an agreed request.
  summary: dict = dataclasses.field(default_factory=dict)  # The final summary's figures.


def check_finite(first_step: int, fetched: list[dict]) -> None:
  """The finite check: raises naming the first step whose loss or norms are NaN or infinite."""
  for i, m in enumerate(fetched):
    bad = [k for k in ('loss', 'grad_norm', 'param_norm') if not math.isfinite(float(m[k]))]
    if bad:
      values = ', '.join(f'{k}={float(m[k])}' for k in bad)
      raise errors.NonFiniteLossError(
          f'Non-finite {values} at step {first_step + i + 1}: training stopped; the newest checkpoint '
          'is from before it. Lower optimizer.learning_rate, enable optimizer.grad_clip_norm, or check '
          'the data.')


def initial_state(run: Run, checkpoints: ckpt_lib.Checkpoints | None, *, restore_from: str | None,
                  params_only: bool, print_fn: Say) -> tuple[TrainState, dict]:
  """(state, data position): resumed from this run, restored from another into this run's layout (only
  what the checkpoint lacks initialised), or drawn from the seed."""
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
    check_lora_base(run, restored.metadata.get('lora_base'))
    return TrainState(**restored.state, frozen=frozen_base(run)), restored.data
  if restore_from is None and run.config.init.hf_checkpoint:
    from mintrain import hf  # safetensors only when asked for.

    path = run.config.init.hf_checkpoint
    print_fn(f'Initialising the parameters from the Hugging Face checkpoint {path}.')
    return with_adapter(run, run.from_base(hf.load_params(path, run)), print_fn), {}
  if restore_from is None:
    return with_adapter(run, run.init(), print_fn), {}
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
    return run.from_params(restored.state['params'], frozen_base(run)), {}
  return TrainState(**restored.state, frozen=frozen_base(run)), restored.data


def with_adapter(run: Run, state: TrainState, print_fn: Say) -> TrainState:
  """`state` with init.lora_adapter's adapters, if it names one."""
  path = run.config.init.lora_adapter
  if not path:
    return state
  from mintrain.lora import peft  # safetensors only when asked for.

  print_fn(f'Initialising the LoRA adapters from the PEFT adapter {path}.')
  params = peft.load_adapter(path, run.config, run.layout, run.abstract_state.params)
  return run.from_params(params, state.frozen)


def check_lora_base(run: Run, saved: dict | None) -> None:
  """Refuses a resume whose LoRA base (init.hf_checkpoint) moved or changed since the checkpoint was saved."""
  path = run.config.init.hf_checkpoint
  if not run.config.lora.enabled or not path or not saved:
    return
  try:
    current = lora.base_fingerprint(path)
  except OSError as e:
    raise errors.CheckpointError(f"The checkpoint's LoRA base {saved['path']} cannot be read at "
                                 f'init.hf_checkpoint={path!r} ({e.strerror}); point it at the base it was '
                                 'trained on.') from None
  if current != saved:
    what = 'moved' if current['path'] != saved['path'] else 'changed'
    raise errors.CheckpointError(f"The checkpoint's LoRA base {saved['path']} {what}: init.hf_checkpoint="
                                 f"{path!r} is not the base the adapters were trained on (its files' "
                                 'fingerprint differs); point it at that base.')


def frozen_base(run: Run) -> nnx.State:
  """The frozen parameters a checkpoint does not hold (LoRA's base; none without LoRA): init.hf_checkpoint's
  weights, or the seed's."""
  path = run.config.init.hf_checkpoint
  if not run.config.lora.enabled or not path:
    return run.frozen_from_seed()
  from mintrain import hf  # safetensors only when asked for.

  return run.from_base(hf.load_params(path, run)).frozen


def _has_saves(workdir: epath.Path | None) -> bool:
  """Whether the workdir's checkpoint directory holds anything (a resume, which ignores init.*)."""
  directory = workdir / ckpt_lib.CHECKPOINTS if workdir is not None else None
  return bool(directory and directory.exists() and any(directory.iterdir()))


def prepare(r: Run, workdir: epath.Path | None, restore_from: str | None, is_main: bool, say: Say,
            tok: tokenizer.Tokenizer
            ) -> tuple[GlobalBatches, GlobalBatches | None, float | None, dict, float, Rollout | None]:
  """What can fail on bad input, checked before the run writes (memory plan, data, tokenizer, HF tensors, the
  objective's rollout): (train batches, eval batches, bytes per token, baseline record, peak TFLOP/s per
  device, the objective's per-step hook)."""
  config = r.config
  say(report.format_report(r.layout, r.abstract_state, r.mesh, r.plan, r.rules, table=False))
  for note in r.notes:
    say(f'note: {note}')
  report.check(r.plan)
  metric_writers.check_wandb(config.metrics)
  measured = config.data.source != 'synthetic' and config.eval.steps > 0  # Without evaluation, no eval split.
  say(tokenizer.describe(tok, config.data.tokenizer, config.init.hf_checkpoint))
  with jax.set_mesh(r.mesh):  # Data first: a bad file or tokenizer stops the run before it writes.
    batches = r.batches(tok)
    eval_batches = r.batches(tok, 'eval') if config.eval.steps else None
    rollout = config.objective.make_rollout(r, tok, batches)
  bytes_per_token = statistics.bytes_per_token(config.data, tok) if measured else None
  baseline = {}
  if measured and is_main:  # A full pass over the eval split: once.
    bits = statistics.unigram_bits_per_token(config.data, tok)
    baseline = {'unigram_bits_per_token': bits, 'unigram_bits_per_byte': bits / bytes_per_token}
  if config.init.hf_checkpoint and restore_from is None and not _has_saves(workdir):
    from mintrain import hf  # safetensors only when asked for.

    hf.check(config.init.hf_checkpoint, r)  # Its tensors and shapes, before the run writes anything.
  flops_per_step, tokens_per_step = report.train_flops_per_step(config), report.tokens_per_step(config)
  peak, peak_source = hardware.peak_tflops(
      r.mesh.devices.flat[0], config.model.compute_dtype, config.metrics.peak_tflops)
  say(f'model: {report.param_count(config):,} parameters, {flops_per_step / 1e9:.3f} GFLOP per step '
      f'({flops_per_step / tokens_per_step / 1e6:.3f} MFLOP per token); peak {peak:.3f} TFLOP/s per '
      f'device ({peak_source})')
  if config.lora.enabled:
    say(f'LoRA {report.trainable_summary(r.layout)}')
  return batches, eval_batches, bytes_per_token, baseline, peak, rollout


def train(r: Run, state: TrainState, batches: GlobalBatches, actions: actions_lib.Actions,
          stop: preemption.StopRequests, timer: Timer, watchdog: Watchdog, say: Say,
          rollout: Rollout | None = None) -> tuple[TrainState, list[float], float, bool]:
  """Steps to `train.steps` or an agreed stop: (state, losses, compile seconds, stopped). The objective's
  `rollout`, if any, turns each data batch into the one the step learns from, and adds its host metrics."""
  first_step, total = int(to_host(state.step)), r.config.train.steps
  train_step, compile_time, stopped, pending, losses = r.train_step, 0.0, False, [], []
  for step in range(first_step, total):
    watchdog.beat()
    actions.profile.before(step + 1)
    wait_start = time.perf_counter()
    batch = next(batches)
    timer.data_wait += time.perf_counter() - wait_start
    timer.spend('data_wait', time.perf_counter() - wait_start)
    host_metrics = {}
    if rollout is not None:
      batch, host_metrics = rollout(state, step, batch)
    if step == first_step:  # Compile ahead, so its time is reported apart from the steps'.
      compile_start = time.perf_counter()
      train_step = train_step.lower(state, batch).compile()
      compile_time = time.perf_counter() - compile_start
      timer.spend('compile', compile_time)
      say(f'compiled the train step in {compile_time:.1f} s')
      distributed.barrier('mintrain: the train step is compiled')
    state, step_metrics = train_step(state, batch)
    pending.append({**step_metrics, **host_metrics})
    if step == first_step:  # The first step's time is left out of the rates.
      jax.block_until_ready(step_metrics)
      timer.restart()
    else:
      timer.steps += 1
    stopped = stop.should_stop(step + 1 - first_step)
    info = StepInfo(step + 1, last=step + 1 == total, stopping=stopped, state=state)
    due = actions.due(info)
    if not due:
      continue
    info.metrics = to_host(pending)  # Waits for the steps dispatched ahead: their time is the interval's.
    timer.pause()
    pending = []
    check_finite(step + 1 - len(info.metrics), info.metrics)
    losses += [float(m['loss']) for m in info.metrics]
    for action in due:
      start = time.perf_counter()
      action(info)
      timer.spend(getattr(action, 'phase', 'other'), time.perf_counter() - start)
    timer.resume()
    if info.stopping:
      break
  return state, losses, compile_time, stopped


def run(config: Config, workdir: str | epath.Path | None, *, devices: Sequence[jax.Device] | None = None,
        restore_from: str | None = None, restore_params_only: bool = False, force: bool = False,
        print_fn: Say = print, tok: tokenizer.Tokenizer | None = None) -> RunResult:
  """Trains `config` up to `config.train.steps` steps on a mesh over `devices`. Process 0 holds the
  workdir's lock from before anything is built to the end; `force` takes it over from a live holder."""
  run_start = time.perf_counter()
  is_main = jax.process_index() == 0
  console = metrics.Console(print_fn)
  say = console.line if is_main else (lambda _: None)
  workdir = None if workdir is None else storage.prepare_dir(workdir)  # A bad one fails before the build.
  timer = Timer()
  with contextlib.ExitStack() as stack:
    stop = stack.enter_context(preemption.StopRequests())  # First: a stop during the set-up is kept.
    stack.enter_context(metrics.console_logging(say))
    if workdir is not None and is_main:
      stack.enter_context(RunLock(workdir, force=force, warn=say))
    run_log = stack.enter_context(actions_lib.RunLog(workdir))
    logs = run_log.path.parent if run_log.path is not None else None  # A remote one: stderr.
    watchdog = stack.enter_context(Watchdog(config.train.hang_timeout_s, logs, _warn))
    caches.use_compilation_cache(config.train.compilation_cache)
    r = build(config, devices)
    config = r.config
    tok = tok or tokenizer.load(config.data.tokenizer)
    batches, eval_batches, bytes_per_token, baseline, peak, rollout = prepare(r, workdir, restore_from,
                                                                              is_main, say, tok)
    actions = actions_lib.Actions(stack, r, workdir, timer, peak, batches, eval_batches, bytes_per_token,
                                  is_main=is_main, say=say, console=console, tok=tok)
    stack.enter_context(jax.set_mesh(r.mesh))
    state, data_state = initial_state(r, actions.checkpoints, restore_from=restore_from,
                                      params_only=restore_params_only, print_fn=say)
    if data_state.get('source') == config.data.source:
      batches.set_state(data_state)
    elif data_state:
      say(f"note: the checkpoint's data position is for data.source={data_state.get('source')!r}; "
          f'starting data.source={config.data.source!r} from its beginning.')
    if config.data.source != 'synthetic' and workdir is not None and is_main:  # For sampling and export.
      tok.save(workdir / tokenizer.RUN_DIR)
    if config.init.hf_checkpoint and workdir is not None and is_main:  # Its special ids, for export.
      from mintrain import hf

      hf.save_sources(config.init.hf_checkpoint, workdir)
    run_log.open()  # Every check has passed: the run writes from here on.
    actions.start_writing()
    batches, actions.evaluation.batches = config.objective.prepare_batches(
        r, state, batches, eval_batches, fresh=lambda split: r.batches(tok, split), workdir=workdir,
        is_main=is_main, say=say)
    first_step = int(to_host(state.step))
    if config.lora.enabled:
      trainable, total = report.trainable_counts(r.layout)
      baseline = {**baseline, 'trainable_parameters': trainable, 'trainable_fraction': trainable / total}
    if baseline:
      actions.log(first_step, baseline)
    timer.spend('startup', time.perf_counter() - run_start)
    state, losses, compile_time, stopped = train(r, state, batches, actions, stop, timer, watchdog, say,
                                                 rollout)
    summary = summarize(r, timer, peak, time.perf_counter() - run_start, compile_time, losses,
                        actions.evaluation.last)
    if losses:
      actions.log(int(to_host(state.step)), {k: v for k, v in summary.items() if k.startswith('time_')}
                  | {'goodput': summary['goodput']})

  last_step = int(to_host(state.step))
  stopped_by = stop.reason if stopped and last_step < config.train.steps else None
  if stopped_by:
    where = (f'saved step {last_step} to {actions.checkpoints.step_dir(last_step)}' if actions.checkpoints
             else 'no workdir, nothing saved')
    cause = f'Received {stop.received}' if stop.received else f'Stopped by {stopped_by}'
    say(f'{cause}: finished step {last_step}, {where}; exiting.')
  if losses:
    say(metrics.format_summary(summary))
  return RunResult(actions.records, losses, state, first_step, stopped_by, summary)


def _warn(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def summarize(r: Run, timer: Timer, peak: float, total_time: float, compile_time: float, losses: list[float],
              evaluation: dict[str, float]) -> dict:
  """The final summary's figures: times, the throughput of every timed step, the last loss and eval."""
  summary = {'total_time_sec': total_time, 'compile_time_sec': compile_time}
  # Goodput (MaxText's): the share of the wall time spent in training steps.
  spent = {phase: timer.phases.get(phase, 0.0) for phase in metrics.TIME_SPLIT if phase != 'steps'}
  loop_time = total_time - spent['startup']
  spent['steps'] = max(loop_time - sum(v for k, v in spent.items() if k != 'startup'), 0.0)
  summary |= {f'time_{phase}_sec': spent[phase] for phase in metrics.TIME_SPLIT}
  summary['goodput'] = spent['steps'] / total_time if total_time > 0 else 0.0
  if timer.all_steps:
    summary.update(metrics.throughput(timer.all_steps, timer.all_seconds,
                                      tokens_per_step=report.tokens_per_step(r.config),
                                      flops_per_step=report.train_flops_per_step(r.config),
                                      num_devices=r.mesh.size, peak_tflops=peak))
    if not r.config.metrics.peak_tflops:
      hardware.observed(r.mesh.devices.flat[0], r.config.model.compute_dtype, summary['tflops_per_device'])
  if losses:
    summary['final_loss'] = losses[-1]
  return summary | {f'final_{k}': v for k, v in evaluation.items()}
