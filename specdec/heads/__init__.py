"""Drafter heads, the small networks that propose from a target's hidden states (their proposers are in
``specdec/proposers``, their training in ``specdec/train``): ``eagle.py`` (the EAGLE-3-style layer), ``medusa.py``,
``mtp.py`` (a model's own multi-token-prediction layers), ``reduced_head.py`` and ``token_freq.py`` (a drafter's LM
head cut to the target's most frequent tokens), ``speculators.py`` (heads in vLLM's speculators layout). The
subdirectories hold the heads shipped for the embedded models (weights, not code)."""
