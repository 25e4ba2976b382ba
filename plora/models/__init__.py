"""Base models: families, loading, GGUF files, Hub ids and the check made before a sweep.

* `plora.models.families` -- one file per family (Llama, Qwen, Gemma 2, Phi-3) behind a table,
  and the LoRA target names (`plora.models.families.targets`: their one home).
* `plora.models.info` -- `ModelInfo`, what plora knows of a model from its config.json.
* `plora.models.shape` -- `ModelShape`, a model's dimensions as planning needs them (presets).
* `plora.models.loading` -- a local Hugging Face folder built as a torchtune decoder.
* `plora.models.gguf` -- a ``.gguf`` file dequantized once into a folder in plora's cache.
* `plora.models.hub_cache` -- Hub model ids, read from the local Hugging Face cache.
* `plora.models.check` -- config, tokenizer and weight names checked at validation.
* `plora.models.torchtune_imports` -- torchtune's modules without its package ``__init__``s
  (datasets, generation, tokenizers), for a job process started ahead.

Importing this package imports none of its modules (no torch): each is imported by name.
"""
