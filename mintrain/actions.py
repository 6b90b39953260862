"""The loop's periodic actions and their config sections."""

from __future__ import annotations

import dataclasses

from mintrain.fields import option


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int = option(at_least=0)
  steps: int = option(at_least=0)  # 0: no evaluation.


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  start_step: int = option(at_least=-1)
  num_steps: int = option(at_least=1)
