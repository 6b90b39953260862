"""The run's figures on its console (the progress line, the `mintrain` loggers' notices while it lasts,
the closing summary) and the throughput they report; `metric_writers` writes them to files.

Throughput follows MaxText's conventions: step time excludes the compiling first
step, model FLOPs come from the analytic count in `report.py`, and MFU divides
the achieved model FLOP/s per device by the device's peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from mintrain.fields import option
from mintrain.runtime import hardware


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  peak_tflops: float = option(at_least=0)
  wandb_project: str = option()
  wandb_entity: str = option()
  wandb_run_name: str = option()
  wandb_tags: str = option()
  wandb_mode: str = option(choices=('online', 'offline'))


Scalars = Mapping[str, float]


def format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=round(seconds)))


CONSOLE = (('loss', 'loss {:.4f}'), ('grpo_reward', 'reward {:.3f}'), ('grad_norm', 'grad_norm {:.3f}'),
           ('learning_rate', 'lr {:.2e}'),
           ('steps_per_sec', '{:.2f} steps/s'), ('tokens_per_sec', '{:,.0f} tok/s'),
           ('tflops_per_device', '{:.3f} TFLOP/s/dev'), ('mfu', 'MFU {:.1%}'),
           ('pipeline_bubble', 'pipeline bubble {:.1%}'),
           ('data_wait_fraction', 'data wait {:.1%}'), ('eval_loss', 'eval_loss {:.4f}'),
           ('eval_perplexity', 'eval_ppl {:.2f}'), ('eval_bits_per_byte', 'eval {:.3f} bits/byte'),
           ('unigram_bits_per_byte', 'eval split unigram entropy {:.3f} bits/byte: the baseline to beat'))


def format_line(step: int, scalars: Scalars, total_steps: int | None = None) -> str:
  head = f'step {step}' if total_steps is None else f'step {step}/{total_steps} ({step / total_steps:.0%})'
  parts = [head] + [fmt.format(scalars[key]) for key, fmt in CONSOLE if key in scalars]
  if 'eta_sec' in scalars:
    parts.append(f"ETA {format_duration(scalars['eta_sec'])}")
  return ' | '.join(parts)


class Console:
  """A run's console. On a terminal, progress records redraw one live line (with a bar); every other
  line ends it first. Elsewhere (a file, a pipe, a test's `print_fn`), plain lines."""

  BAR = 20

  def __init__(self, print_fn: Callable[[str], None] = print):
    self.print_fn, self.open = print_fn, False
    self.live = print_fn is print and sys.stdout.isatty()

  def line(self, text: str) -> None:
    if self.open:
      print(flush=True)
      self.open = False
    self.print_fn(text)

  def progress(self, step: int, total: int, text: str) -> None:
    if not self.live:
      self.print_fn(text)
      return
    done = round(self.BAR * step / total)
    line = f"[{'#' * done}{'.' * (self.BAR - done)}] {text}"
    width = shutil.get_terminal_size().columns  # A wrapped line could not be redrawn.
    print(f'\r\x1b[K{line[:width - 1]}', end='', flush=True)
    self.open = True


class ConsoleWriter:
  """One line per record: progress, the figures in CONSOLE, and the ETA; training records are the live
  line on a terminal."""

  def __init__(self, console: Console, total_steps: int):
    self.console, self.total_steps = console, total_steps

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    if not any(key in scalars for key, _ in CONSOLE):  # The time split is in the summary line instead.
      return
    line = format_line(step, scalars, self.total_steps)
    if 'loss' in scalars:
      self.console.progress(step, self.total_steps, line)
    else:
      self.console.line(line)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    pass  # The config is in hparams.json and TensorBoard; on the console it would bury the report.

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class _Console(logging.Handler):
  """mintrain's log records during a run: warnings to stderr on every process, notices to `say`."""

  def __init__(self, say: Callable[[str], None]):
    super().__init__(logging.INFO)
    self.say = say

  def emit(self, record: logging.LogRecord) -> None:
    if record.levelno >= logging.WARNING:
      print(record.getMessage(), file=sys.stderr, flush=True)
    else:
      self.say(record.getMessage())


@contextlib.contextmanager
def console_logging(say: Callable[[str], None]) -> Iterator[None]:
  """While a run lasts, the `mintrain` loggers (the data threads' notices and warnings) print to its
  console only (not also through the root logger's handlers, which absl installs); outside one they follow
  the process's logging set-up."""
  logger, handler = logging.getLogger('mintrain'), _Console(say)
  level, propagate = logger.level, logger.propagate
  logger.setLevel(logging.INFO)
  logger.addHandler(handler)
  logger.propagate = False
  try:
    yield
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate


# The run's wall time by what it went to; goodput is the share of 'steps'.
TIME_SPLIT = ('startup', 'compile', 'steps', 'data_wait', 'checkpointing', 'evaluation', 'logging',
              'profiling')


def format_summary(s: Mapping[str, float]) -> str:
  parts = [f"total {format_duration(s['total_time_sec'])}", f"compile {s['compile_time_sec']:.1f} s"]
  if 'step_time' in s:
    parts += [f"mean step {s['step_time'] * 1e3:.1f} ms", f"{s['tokens_per_sec']:,.0f} tok/s",
              f"{s['tflops_per_device']:.3f} TFLOP/s/dev", f"MFU {s['mfu']:.1%}"]
  if 'goodput' in s:
    split = ', '.join(f"{name.replace('_', ' ')} {s[f'time_{name}_sec']:.1f} s" for name in TIME_SPLIT
                      if s.get(f'time_{name}_sec', 0.0) >= 0.05)
    parts.append(f"goodput {s['goodput']:.1%} ({split})")
  if 'final_loss' in s:
    parts.append(f"final loss {s['final_loss']:.4f}")
  if 'final_eval_loss' in s:
    bpb = f" ({s['final_eval_bits_per_byte']:.3f} bits/byte)" if 'final_eval_bits_per_byte' in s else ''
    parts.append(f"final eval loss {s['final_eval_loss']:.4f}{bpb}")
  return 'summary: ' + ', '.join(parts)


def throughput(steps: int, seconds: float, *, tokens_per_step: int, flops_per_step: float,
               num_devices: int, peak_tflops: float) -> dict[str, float]:
  """Rates of an interval of `steps` steps that took `seconds`."""
  step_time = seconds / steps
  flops_per_device = flops_per_step / step_time / num_devices
  return {'step_time': step_time, 'steps_per_sec': 1 / step_time,
          'tokens_per_sec': tokens_per_step / step_time,
          'tokens_per_sec_per_device': tokens_per_step / step_time / num_devices,
          'tflops_per_device': flops_per_device / 1e12, 'mfu': hardware.mfu(flops_per_device, peak_tflops)}
