"""Pooling models behind ``vllm serve --runner pooling`` on the simulated GCU (and, for
the decoder embedding model and the reranker, the virtual GCU), through the OpenAI
client and vLLM's scoring endpoints, against HF transformers float64:

- an encoder-only embedding model (BERT, CLS pooling): ``/v1/embeddings`` for strings
  and token ids;
- a decoder embedding model (Qwen3, Qwen3-Embedding style: last-token pooling);
- a cross-encoder reranker (BertForSequenceClassification, one label): ``/score`` and
  ``/rerank`` give HF's sigmoid of the pair's logit, the rerank order sorted by it.

Tiny random-weight checkpoints with the default model's tokenizer (and its vocabulary
size, so text requests tokenize into the embedding table).
"""

import httpx
import pytest
import torch

from conftest import VIRTUAL_GCU_ENV, start_server, stop_server
from quantizer import _copy_side_files

VOCAB = 49152
TEXTS = ["The capital of France is Paris.", "GCUs serve language models.",
         "A tiny random model, a long sentence that crosses several positions in a row."]


def save_checkpoint(model, path, default_model):
    """``model`` with weights N(0, 0.08) (logits spread well beyond rounding), saved with
    the default model's tokenizer."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _copy_side_files(default_model, path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model):
    import transformers

    root = tmp_path_factory.mktemp("pooling")
    torch.manual_seed(0)
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=256,
                                   max_position_embeddings=512)
    qwen3 = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     intermediate_size=256, max_position_embeddings=1024,
                                     tie_word_embeddings=True)
    ranker = transformers.BertConfig(**bert.to_dict(), num_labels=1)
    ranker.architectures = ["BertForSequenceClassification"]
    return {
        "bert": save_checkpoint(transformers.BertModel(bert, add_pooling_layer=False),
                                root / "bert", default_model),
        "qwen3": save_checkpoint(transformers.Qwen3ForCausalLM(qwen3), root / "qwen3",
                                 default_model),
        "ranker": save_checkpoint(transformers.BertForSequenceClassification(ranker),
                                  root / "ranker", default_model),
    }


#: where a server runs: the simulator, or the card path on the virtual GCU
PATHS = {"sim": {}, "virtual": {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}}


def _serve(model, tmp_path, *args, path="sim"):
    proc, url = start_server([str(model), "--device", "gcu", "--runner", "pooling", "--dtype",
                              "float32", "--max-model-len", "256", *args],
                             tmp_path / "server.log", env=PATHS[path])
    if path == "virtual":
        assert "device gcu via virtual" in (tmp_path / "server.log").read_text()
    return proc, url


def _hf(model_dir, cls):
    import transformers

    return (getattr(transformers, cls).from_pretrained(model_dir, dtype=torch.float64,
                                                       attn_implementation="eager"),
            transformers.AutoTokenizer.from_pretrained(model_dir))


def _assert_embeddings(got, want):
    got = torch.tensor(got, dtype=torch.float64)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.server
def test_encoder_embeddings_endpoint(checkpoints, tmp_path):
    from openai import OpenAI

    hf, tok = _hf(checkpoints["bert"], "BertModel")
    # eager: the endpoint is what this tests; test_attention_models compiles BERT
    proc, url = _serve(checkpoints["bert"], tmp_path, "--enforce-eager")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        ids = [tok(t)["input_ids"] for t in TEXTS]
        for request in (TEXTS, ids):
            data = client.embeddings.create(model=model, input=request).data
            for item, seq in zip(data, ids, strict=True):
                with torch.no_grad():
                    cls = hf(torch.tensor([seq])).last_hidden_state[0, 0]
                _assert_embeddings(item.embedding, torch.nn.functional.normalize(cls, dim=0))
    finally:
        stop_server(proc)


@pytest.mark.server
@pytest.mark.parametrize("path", list(PATHS))
def test_decoder_embedding_model_pools_the_last_token(path, checkpoints, tmp_path):
    from openai import OpenAI

    hf, tok = _hf(checkpoints["qwen3"], "Qwen3Model")
    proc, url = _serve(checkpoints["qwen3"], tmp_path, "--pooler-config",
                       '{"seq_pooling_type": "LAST", "use_activation": true}', path=path)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        data = client.embeddings.create(model=model, input=TEXTS).data
        for item, text in zip(data, TEXTS, strict=True):
            with torch.no_grad():
                last = hf(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
            _assert_embeddings(item.embedding, torch.nn.functional.normalize(last, dim=0))
    finally:
        stop_server(proc)


@pytest.mark.server
@pytest.mark.parametrize("path", list(PATHS))
def test_cross_encoder_score_and_rerank(path, checkpoints, tmp_path):
    hf, tok = _hf(checkpoints["ranker"], "BertForSequenceClassification")
    query, docs = TEXTS[0], TEXTS

    def hf_score(doc, pair=True):
        with torch.no_grad():
            enc = tok(*((query, doc) if pair else (doc,)), return_tensors="pt")
            return float(torch.sigmoid(hf(**enc).logits[0, 0]))

    want = [hf_score(d) for d in docs]
    # eager: the scoring endpoints are under test; test_attention_models compiles BERT
    proc, url = _serve(checkpoints["ranker"], tmp_path, "--enforce-eager", path=path)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{url}/score", json={"model": model, "queries": query,
                                             "documents": docs}, timeout=60)
        assert r.status_code == 200, r.text
        got = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        assert got == pytest.approx(want, abs=1e-5)
        r = httpx.post(f"{url}/rerank", json={"model": model, "query": query,
                                              "documents": docs}, timeout=60)
        assert r.status_code == 200, r.text
        ranked = r.json()["results"]
        assert [x["index"] for x in ranked] == sorted(range(len(docs)), key=lambda i: -want[i])
        assert [x["relevance_score"] for x in ranked] == pytest.approx(sorted(want)[::-1],
                                                                        abs=1e-5)
        # /classify: each text alone
        r = httpx.post(f"{url}/classify", json={"model": model, "input": docs}, timeout=60)
        assert r.status_code == 200, r.text
        got = [d["probs"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        assert got == [pytest.approx([hf_score(d, pair=False)], abs=1e-5) for d in docs]
    finally:
        stop_server(proc)
