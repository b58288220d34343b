"""`specdec train medusa` end to end on a tiny target (data, features, training, accuracies in the
config, evaluation, resumption), and the offsets of its loss and accuracies on synthetic states."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import CORPUS, make_model_dir
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.heads.medusa import MedusaConfig, MedusaHeads, init_heads, load_heads
from specdec.proposers.medusa import sparse_tree
from specdec.train.medusa import medusa_loss, top_accuracies
from specdec.train.train import TrainConfig


def periodic_shard(tmp_path, period: int = 4, n: int = 40):
    """States whose LM head (the identity) gives token ``p % period`` at position p."""
    from safetensors.torch import save_file
    tok = torch.arange(n) % period
    final = torch.nn.functional.one_hot(tok, 8).float() * 10
    path = tmp_path / "shard.safetensors"
    save_file({"offsets": torch.tensor([0, n // 2, n]), "final": final.to(torch.bfloat16),
               "tokens": tok.int()}, str(path))
    return path, torch.eye(8)


def test_head_k_is_scored_on_the_token_k_after_the_targets_next(tmp_path):
    """Identity heads repeat the target's next token t+1; head k is scored on token t+1+k, so with a
    period-4 target only head 4 is right, and its loss is the target's own entropy."""
    path, lm = periodic_shard(tmp_path)
    heads = init_heads(MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=8, num_heads=4)))  # W = 0, b = 0
    acc = top_accuracies(heads, lm, [path], topk=3)
    assert [round(a[0], 6) for a in acc] == [0.0, 0.0, 0.0, 1.0]
    from safetensors.torch import load_file
    _, accs, n = medusa_loss(heads, lm, TrainConfig())(load_file(str(path)), (0, 20))
    assert accs == [0.0, 0.0, 0.0, 1.0] and n == 19


def test_a_training_vocabulary_renormalises_both_laws_over_its_rows(tmp_path):
    """Over rows 0-3 (every token the period-4 target says) the accuracies stay, and each head's loss is
    the cross-entropy of the two softmaxes over those rows only, computed here by hand."""
    path, lm = periodic_shard(tmp_path)
    heads = init_heads(MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=8, num_heads=4)))
    shard = load_file(str(path))
    loss, accs, _ = medusa_loss(heads, lm[:4], TrainConfig())(shard, (0, 20))
    assert accs == [0.0, 0.0, 0.0, 1.0]
    final = shard["final"][:20].float()
    logq = torch.log_softmax(final @ lm[:4].T, -1)  # identity heads: head k's logits are final[p]'s
    want = sum(0.8 ** (k - 1) * -(torch.softmax(final[k:] @ lm[:4].T, -1) * logq[:20 - k]).sum(-1).mean()
               for k in range(1, 5))
    loss = loss.detach()
    assert abs(float(loss) - float(want)) < 0.05 * float(want)
    full, _, _ = medusa_loss(heads, lm, TrainConfig())(shard, (0, 20))
    assert float(full.detach()) > float(loss)  # the four unused rows carry mass in the full softmaxes


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("medusa-train") / "t", layers=2, hidden=64, seed=0)


def test_train_medusa_measures_the_tree_and_the_heads_draft_losslessly(target, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": (CORPUS[i % len(CORPUS)] + " ") * 3}) for i in range(40)))
    out = tmp_path / "run"
    argv = ["train", "medusa", "--model", str(target), "--output", str(out), "--data", str(data),
            "--max-seq-len", "64", "--seq-len", "32", "--batch-tokens", "64", "--epochs", "1", "--num-heads", "3",
            "--topk", "4", "--heldout-per-mille", "200", "--eval-prompts", "1", "--final-eval-prompts", "2",
            "--eval-tokens", "8", "--threads", "1", "--lr", "3e-3", "--train-vocab-size", "40"]
    assert main(argv) == 0
    heads = load_heads(out / "head")
    acc = heads.config.top_accuracies
    assert len(acc) == 3 and all(len(r) == 4 and 0 <= sum(r) <= 1 + 1e-6 for r in acc)
    assert heads.config.target == str(target) and heads.heads[0].linear.weight.abs().sum() > 0
    assert json.loads((out / "heldout.json").read_text())["top_accuracies"] == acc
    assert json.loads((out / "head" / "eval.json").read_text())["k"] == 8
    assert (out / "head" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the training curve
    assert sparse_tree(acc, 8)  # the tree comes from them
    ids = load_file(str(out / "vocab.safetensors"))["d2t_ids"]
    assert ids.numel() == 40 and torch.equal(heads.vocab, ids.long())  # the loss's vocabulary, drafted from
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "medusa", "model": str(out / "head"), "num_speculative_tokens": 6})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for p in ["The quick brown fox", "def fibonacci(n):"]:
        assert llm.generate(p, params)[0].outputs[0].token_ids == \
            llm.generate(p, params, num_speculative_tokens=0)[0].outputs[0].token_ids
    stamp = (out / "checkpoint.pt").stat().st_mtime_ns  # a rerun resumes: training is done, nothing redone
    assert main(argv) == 0
    assert (out / "checkpoint.pt").stat().st_mtime_ns == stamp
