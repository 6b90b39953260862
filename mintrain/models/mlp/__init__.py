"""The tutorial MLP family: a bag-of-tokens next-token model with Megatron column/row pairs."""

from mintrain.models.family import Family
from mintrain.models.mlp.model import MLP, MLPConfig

# The MLP splits no activation along anything its placement decides.
FAMILY = Family(config=MLPConfig, make=lambda cfg, rules, placement, rngs: MLP(cfg, rules=rules, rngs=rngs))
