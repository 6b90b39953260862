"""Training objectives by `train.objective`; each is one module that owns everything about itself (its
options, the data it reads, its loss and metrics), and the train step calls it without asking which.

A new objective is a module here with an `OBJECTIVE` (`objective.Objective`) and one line in `OBJECTIVES`.
"""

from __future__ import annotations

from mintrain.objectives import dpo, grpo, lm
from mintrain.objectives.objective import Objective

OBJECTIVES: dict[str, Objective] = {
    'lm': lm.OBJECTIVE,
    'dpo': dpo.OBJECTIVE,
    'grpo': grpo.OBJECTIVE,
}
