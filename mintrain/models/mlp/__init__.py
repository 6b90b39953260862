"""The tutorial MLP family: a bag-of-tokens next-token model with Megatron column/row pairs."""
