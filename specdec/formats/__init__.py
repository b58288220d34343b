"""From a file to a model: Hugging Face directories (``hf.py``), GGUF files read in place (``gguf_reader.py`` the
metadata and tensor table over the file's map, ``gguf_model.py`` the model straight from it, ``gguf_blocks.py`` each
block type into the kernels' exact tiles, ``gguf_file.py`` the family's names and a conversion for transformers),
the embedded models and the cache (``hub.py``, ``registry.py``, ``progress.py``), tokenizers (``tokenizer.py``,
``vocab_map.py``), and ``loader.py``: a name, directory or file -> a runnable model with its tokenizer."""
