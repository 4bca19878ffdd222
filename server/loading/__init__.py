"""Finding a model and reading its files: local directory, .gguf file or Hub id; config, tokenizer
and checkpoint tensors; GGUF parsed once; quantized-checkpoint formats; the transformers-version
shims; the default model. What every shard reads before its weights is `description`."""
