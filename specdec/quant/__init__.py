"""Every weight product's module, the Python side of the kernels' products: ``linear.py`` (``Linear``: bf16 or fp32
weights, batch-invariant rows), ``qlinear.py`` (``QLinear``: int8 / int4 / a GGUF file's blocks in the kernels'
tiles; the embedding looked up in quantized rows), ``mxfp4.py`` and ``mxfp4_codes.py`` (gpt-oss's MXFP4 experts,
decoded exactly and kept as codes)."""
