"""Rerankers and sequence classifiers through vLLM's pooling runner (``LLM.classify`` on
token ids: the model's forward and head, which vLLM's scoring endpoints run on the
pairs they tokenize; ``test_pooling_server.py`` serves ``/score``, ``/rerank`` and
``/classify`` for a BERT cross-encoder), on the simulator and the virtual GCU, each
prompt's class probabilities within 1e-5 of HF transformers float64:

- ``xlm_roberta``: XLMRobertaForSequenceClassification, one label (bge-reranker-v2-m3,
  bge-reranker-large): a dense + tanh head over the CLS token, sigmoid;
- ``modernbert``: ModernBertForSequenceClassification, one label, mean pooling
  (gte-reranker-modernbert): a two-way window on alternate layers, sigmoid;
- ``qwen3_classifier``: Qwen3ForSequenceClassification, three labels (the converted
  Qwen3-Reranker "seq-cls" checkpoints and classifier fine-tunes): a score head over
  the last token, softmax;
- ``qwen3_reranker``: the released Qwen3-Reranker, a Qwen3ForCausalLM, served with
  the ``--hf-overrides`` vLLM documents for it: p(yes) = sigmoid(logit("yes") -
  logit("no")) at the last token, vLLM building the score row from the LM head.

Random-weight checkpoints (4 heads of 32, two layers) with the default model's
tokenizer; the simulator's engines run one after another in one process, the virtual
GCU's in another (``conftest.SharedEngines``).
"""

import random

import pytest
import torch

from conftest import VIRTUAL_GCU_ENV, SharedEngines
from test_pooling_server import save_checkpoint

SIM = {}
VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: Qwen3-Reranker's two answer tokens (in the default model's tokenizer too)
ANSWERS = ["no", "yes"]
#: vLLM's documented overrides for the released Qwen3-Reranker checkpoints
QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ANSWERS,
                            "is_original_qwen3_reranker": True}
#: family: what the support table says it adds
FAMILIES = {
    "xlm_roberta": "XLMRobertaForSequenceClassification, one label: dense + tanh head over "
                   "the CLS token, sigmoid (bge-reranker-v2-m3)",
    "modernbert": "ModernBertForSequenceClassification, one label: mean pooling over "
                  "two-way windowed and global layers, sigmoid (gte-reranker-modernbert)",
    "qwen3_classifier": "Qwen3ForSequenceClassification, three labels: a score head over "
                        "the last token, softmax (Qwen3-Reranker seq-cls conversions, "
                        "classifier fine-tunes)",
    "qwen3_reranker": "Qwen3ForCausalLM served as a reranker (vLLM's hf_overrides): "
                      "sigmoid of the 'yes' minus 'no' logits at the last token "
                      "(Qwen3-Reranker)",
}
#: family: its row's name in the support table
LABELS = {"xlm_roberta": "xlm_roberta (reranker)", "modernbert": "modernbert (reranker)",
          "qwen3_classifier": "qwen3 (sequence classifier)",
          "qwen3_reranker": "qwen3 (Qwen3-Reranker through hf_overrides)"}
#: name: (family, path env, compiled)
CASES = {
    "xlm_roberta-sim-compiled": ("xlm_roberta", SIM, True),
    "xlm_roberta-virtual": ("xlm_roberta", VIRTUAL, False),
    "modernbert-sim-compiled": ("modernbert", SIM, True),
    "modernbert-virtual": ("modernbert", VIRTUAL, False),
    "qwen3_classifier-sim-compiled": ("qwen3_classifier", SIM, True),
    "qwen3_classifier-virtual": ("qwen3_classifier", VIRTUAL, False),
    "qwen3_reranker-sim-compiled": ("qwen3_reranker", SIM, True),
    "qwen3_reranker-virtual": ("qwen3_reranker", VIRTUAL, False),
}
ENCODER = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=514, pad_token_id=1,
               bos_token_id=0, eos_token_id=2)
DECODER = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, intermediate_size=256,
               max_position_embeddings=1024, rms_norm_eps=1e-5)


def _config(family: str):
    import transformers

    if family == "xlm_roberta":
        return transformers.XLMRobertaConfig(vocab_size=512, num_labels=1, **ENCODER,
                                             position_embedding_type="absolute")
    if family == "modernbert":
        return transformers.ModernBertConfig(
            vocab_size=512, num_labels=1, classifier_pooling="mean", local_attention=16,
            layer_types=["sliding_attention", "full_attention"], cls_token_id=0,
            sep_token_id=2, **ENCODER)
    # the Qwen3 models keep the tokenizer's vocabulary: the reranker's answer tokens
    # ("no" 4607, "yes" 10407) must be rows of its LM head
    qwen3 = dict(vocab_size=49152, pad_token_id=0, **DECODER)
    if family == "qwen3_classifier":
        return transformers.Qwen3Config(num_labels=3, tie_word_embeddings=False, **qwen3)
    return transformers.Qwen3Config(tie_word_embeddings=True, **qwen3)  # (as released)


def _hf_class(family: str):
    """HF's auto class of ``family``: the released Qwen3-Reranker is a causal LM."""
    import transformers

    return (transformers.AutoModelForCausalLM if family == "qwen3_reranker"
            else transformers.AutoModelForSequenceClassification)


def build(path, family: str, default_model, seed: int):
    """``family``'s random-weight checkpoint (weights N(0, 0.08), so class logits spread
    well beyond rounding) with the default model's tokenizer."""
    config = _config(family)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    return save_checkpoint(_hf_class(family).from_config(config, dtype=torch.float32),
                           path, default_model)


def hf_probs(model_dir, family: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF float64 class probabilities of each prompt (the reranker's: p(yes), from the
    two answer tokens' logits at the last position)."""
    import transformers

    hf = _hf_class(family).from_pretrained(model_dir, dtype=torch.float64,
                                           attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0]
        if family == "qwen3_reranker":
            no, yes = logits[-1, tok.convert_tokens_to_ids(ANSWERS)]
            out.append(torch.sigmoid(yes - no).reshape(1))
        elif logits.numel() == 1:
            out.append(torch.sigmoid(logits))
        else:
            out.append(torch.softmax(logits, -1))
    return out


def _prompts(case):
    rng = random.Random(case)
    return [[0] + [rng.randrange(3, 512) for _ in range(n)] + [2] for n in (5, 60, 1, 130)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("rerankers")
    return {family: build(root / family, family, default_model, seed)
            for seed, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    def spec(case):
        family, _, compiled = CASES[case]
        llm = {"model": str(models[family]), "runner": "pooling", "dtype": "float32",
               "enforce_eager": not compiled, "max_model_len": 256, "seed": 0}
        if family == "qwen3_reranker":
            llm["hf_overrides"] = QWEN3_RERANKER_OVERRIDES
        return {"llm": llm, "classify": _prompts(case), "sampling": {}}

    return SharedEngines({case: (spec(case), env) for case, (_, env, _) in CASES.items()},
                         tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_classifier_probabilities_match_hf(case, models, engines):
    """Four prompts of 3 to 132 tokens in one batch: each one's probabilities within
    1e-5 of HF float64's."""
    family, env, compiled = CASES[case]
    results, log = engines(case)
    assert ("Warming up model for the compilation" in log) == compiled
    if env is VIRTUAL:
        assert "device gcu via virtual" in log
    want = hf_probs(models[family], family, _prompts(case))
    for got, expected in zip(results["probs"], want, strict=True):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected,
                                   atol=1e-5, rtol=0)
    # the prompts score apart (a pooling of the wrong token would show), away from 0
    # and 1 (where 1e-5 would say little)
    first = [float(p[0]) for p in want]
    assert max(first) - min(first) > 0.02 and 0.01 < min(first) and max(first) < 0.99, first
