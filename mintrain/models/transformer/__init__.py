"""The decoder-only transformer family: Llama, Mistral, Qwen2, Gemma and their mixtures of experts."""
