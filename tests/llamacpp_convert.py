"""Run llama.cpp's own converter (``convert_hf_to_gguf.py``) over several model directories in one
process: its imports take most of a conversion's ~10 s, a tiny model's tensors a fraction of one.

    python tests/llamacpp_convert.py LLAMA_CPP_SOURCE JOBS.json

JOBS.json: ``[[model_dir, outtype, outfile, [extra converter arguments]], ...]``. The converter runs
with its own ``gguf-py`` (first on sys.path, as the script puts it) and is changed in two places only,
both for what the tests' tiny models lack beside a real one:

- their byte-level BPE tokenizer (GPT-2's pre-tokenizer, trained on a few lines) is not among the
  converter's known pre-tokenizers, which it recognises by the hash of a tokenized test text: an
  unknown one is registered as ``gpt-2``, what it is (as ``convert_hf_to_gguf_update.py`` would
  register a new model's);
- where the converter insists on a sentencepiece ``tokenizer.model`` (Gemma 2; Phi-3, whose Phi-4-mini
  takes the BPE path through its GPT2Tokenizer class), a directory without one gets the BPE vocabulary;
  so does a GLM-4.5 directory whose tokenizer lacks GLM's special tokens (``[gMASK]``, ``<|user|>``, ...,
  which the converter's ``_set_vocab_glm`` names as bos, eot, unk and eom).
"""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    src, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import conversion.base as base
    from conversion import gemma, glm, phi

    known_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:  # an unregistered tokenizer: the tests' GPT-2-style one
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    for cls in (gemma.Gemma2Model, phi.Phi3MiniModel):
        def set_vocab(self, _sentencepiece=cls.set_vocab):
            if (self.dir_model / "tokenizer.model").is_file():
                return _sentencepiece(self)
            return self._set_vocab_gpt2()

        cls.set_vocab = set_vocab

    def glm_vocab(self, _glm=glm.Glm4MoeModel.set_vocab):
        tok = json.loads((self.dir_model / "tokenizer.json").read_text()) if (self.dir_model / "tokenizer.json").is_file() else {}
        if any(t.get("content") == "[gMASK]" for t in tok.get("added_tokens", [])):
            return _glm(self)
        return self._set_vocab_gpt2()

    glm.Glm4MoeModel.set_vocab = glm_vocab
    script = str(src / "convert_hf_to_gguf.py")
    converter = runpy.run_path(script, run_name="convert_hf_to_gguf")
    for model_dir, outtype, outfile, *extra in jobs:
        sys.argv = [script, model_dir, "--outtype", outtype, "--outfile", outfile, *(extra[0] if extra else [])]
        converter["main"]()


if __name__ == "__main__":
    main()
