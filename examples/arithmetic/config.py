"""GRPO on the arithmetic task (examples/arithmetic/README.md): run from the repository root with
PYTHONPATH=examples/arithmetic, so the reward module imports."""

from mintrain.configs import dp4_tp2


def get_config():
  c = dp4_tp2.get_config()
  c.train.objective = 'grpo'
  c.data.source, c.data.format = 'jsonl', 'prompt'
  c.data.path = 'examples/arithmetic/prompts.jsonl'
  c.data.tokenizer = 'byte'
  c.grpo.reward = 'arithmetic_rewards:exact_answer,arithmetic_rewards:starts_with_a_number'
  c.grpo.reward_weights = (1.0, 0.1)
  c.grpo.group_size = 8
  c.grpo.max_new_tokens = 6
  c.grpo.kl_coef = 0.02
  c.train.seq_len = 16
  c.train.global_batch_size = 64  # 8 prompts x 8 completions.
  c.train.steps = 200
  c.train.log_every = 10
  c.eval.steps = 0
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 10
  return c
