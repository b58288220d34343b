"""The network: ``llama.py`` (the Llama block and every family's switches, the readable reference), ``moe.py``,
``recurrent.py`` (hybrids' token mixers), ``masks.py``, ``native.py`` (the native twin of a forward for blocks of
tokens), ``cuda_graphs.py``, and ``runner.py`` (the model run over its paged cache: prefill in chunks, blocks of
rows). Its weights come from ``specdec/formats``, its products from ``specdec/quant``."""
