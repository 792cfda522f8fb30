"""Model implementations behind the `CausalLM` and `Tokenizer` seams, and the loader that picks one."""
