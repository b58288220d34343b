"""specdec: lossless speculative decoding for Llama-family LLMs."""
from specdec.config import SamplingParams
from specdec.errors import SpecdecError


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it only when asked for
    if name == "LLM":
        from specdec.llm import LLM  # noqa: PLC0415
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "SpecdecError"]
__version__ = "0.1.0"
