"""Dataset uploads over HTTP: Miles keys, slicing, length filters, bad lines, versions."""

from __future__ import annotations

import io

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.gateway_support import RunningGateway, gateway_config

pytestmark = pytest.mark.one_broker(
    "uploads go to Delta; the broker is not on their path")


def _jsonl(*rows: object) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved to a local folder (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("one two three four five".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture
def gw(kafka, lake_root, tmp_path, tokenizer_dir):
    config = gateway_config(kafka, lake_root, tmp_path / "state",
                            tokenizers={"tiny": str(tokenizer_dir)},
                            dataset_line_limit_bytes=4096, dataset_limit_bytes=1024 * 1024)
    with RunningGateway(config) as running, running.client() as client:
        yield client


def _upload(client, name, body, **params):
    params.setdefault("filename", "data.jsonl")
    return client.post(f"/v1/datasets/{name}", params=params, content=body)


def _prompts(client, name, **params):
    rows = client.get(f"/v1/datasets/{name}/rows", params=params).json()["rows"]
    return [r["prompt"] for r in rows]


def test_miles_keys_chat_prompts_labels_metadata_and_tools(gw):
    body = _jsonl(
        {"q": "one two", "a": 4, "meta": {"src": "x"}, "tools": '[{"name": "calc"}]'},
        {"q": [{"role": "user", "content": "three"}], "a": "b", "meta": None},
    )
    response = _upload(gw, "chat", body, input_key="q", label_key="a", metadata_key="meta")
    assert response.status_code == 201, response.text
    assert response.json()["rows_kept"] == 2
    rows = gw.get("/v1/datasets/chat/rows").json()["rows"]
    assert rows[0]["prompt"] == "one two" and rows[0]["label"] == 4
    assert rows[0]["metadata"] == {"src": "x", "tools": [{"name": "calc"}]}
    assert rows[1]["prompt"] == [{"role": "user", "content": "three"}]
    assert rows[1]["metadata"] == {} and rows[1]["label"] == "b"


def test_bad_lines_are_reported_with_line_numbers(gw):
    body = (_jsonl({"input": "a"}) + b"not json\n\n" + _jsonl({"other": 1}) + b"[1, 2]\n"
            + b'{"input": "caf\xe9"}\n' + _jsonl({"input": 7}) + b'{"input": "x" '
            + b"y" * 5000 + b"}\n" + _jsonl({"input": "b"}))
    response = _upload(gw, "bad", body)
    assert response.status_code == 201, response.text
    report = response.json()
    assert report["rows_kept"] == 2 and report["bad_line_count"] == 6
    reasons = {b["line"]: b["reason"] for b in report["bad_lines"]}
    assert "not valid JSON" in reasons[2]
    assert "missing input key 'input'" in reasons[4]
    assert "not an object" in reasons[5]
    assert "not valid UTF-8" in reasons[6]
    assert "must be a string or a list" in reasons[7]
    assert "longer than 4096 bytes" in reasons[8]
    assert _prompts(gw, "bad") == ["a", "b"]


def test_missing_label_key_is_a_bad_line(gw):
    response = _upload(gw, "lab", _jsonl({"input": "a", "label": 1}, {"input": "b"}),
                       label_key="label")
    assert response.json()["bad_lines"] == [{"line": 2, "reason": "missing label key 'label'"}]


@pytest.mark.parametrize("body", [b"", b"\n\n", b"garbage\n"])
def test_upload_without_valid_rows_is_422_and_writes_no_version(gw, body):
    response = _upload(gw, "empty", body)
    assert response.status_code == 422
    assert "no valid rows" in response.json()["detail"]
    assert gw.get("/v1/datasets/empty").status_code == 404


def test_wrong_extension_is_415(gw):
    response = _upload(gw, "csv", b"a,b\n", filename="data.csv")
    assert response.status_code == 415
    assert ".jsonl or .parquet" in response.json()["detail"]
    multipart = gw.post("/v1/datasets/csv", files={"file": ("x.txt", b"{}", "text/plain")})
    assert multipart.status_code == 415


@pytest.mark.parametrize("slice_, expected", [
    ("@[1:3]", ["p1", "p2"]), ("[-2:]", ["p3", "p4"]), ("@[:-3]", ["p0", "p1"]),
    ("@[-4:-2]", ["p1", "p2"]),
])
def test_slice_counts_valid_rows_and_accepts_negative_bounds(gw, slice_, expected):
    body = b"junk\n" + _jsonl(*({"input": f"p{i}"} for i in range(5)))
    response = _upload(gw, "sl", body, slice=slice_)
    assert response.status_code == 201
    assert response.json()["rows_sliced_out"] == 5 - len(expected)
    assert _prompts(gw, "sl") == expected


def test_bad_slice_is_422(gw):
    response = _upload(gw, "sl", _jsonl({"input": "a"}), slice="[1:2:3]")
    assert response.status_code == 422 and "@[start:end]" in response.json()["detail"]


def test_max_prompt_len_in_characters_and_in_tokens(gw):
    body = _jsonl({"input": "one"}, {"input": "one two three"}, {"input": "four five"})
    chars = _upload(gw, "len", body, max_prompt_len=9)
    assert chars.json()["rows_filtered"] == 1 and chars.json()["length_unit"] == "characters"
    assert _prompts(gw, "len") == ["one", "four five"]
    tokens = _upload(gw, "len", body, max_prompt_len=2, tokenizer="tiny")
    assert tokens.json()["rows_filtered"] == 1 and tokens.json()["length_unit"] == "tokens"
    assert _prompts(gw, "len") == ["one", "four five"]
    unknown = _upload(gw, "len", body, max_prompt_len=2, tokenizer="gpt-x")
    assert unknown.status_code == 422 and "unknown tokenizer 'gpt-x'" in unknown.json()["detail"]
    none_left = _upload(gw, "len", body, max_prompt_len=1)
    assert none_left.status_code == 422 and "no rows left" in none_left.json()["detail"]


def test_parquet_multipart_and_versions_with_time_travel(gw):
    buf = io.BytesIO()
    pq.write_table(pa.table({"input": ["a", "b", "c"], "label": [1, 2, 3]}), buf)
    first = gw.post("/v1/datasets/pq", params={"label_key": "label"},
                    files={"file": ("train.parquet", buf.getvalue())})
    assert first.status_code == 201, first.text
    assert first.json()["version"] == 0
    second = _upload(gw, "pq", _jsonl({"input": "z"}))
    assert second.json()["version"] == 1
    assert _prompts(gw, "pq") == ["z"]
    assert _prompts(gw, "pq", version=0) == ["a", "b", "c"]
    info = gw.get("/v1/datasets/pq", params={"version": 0}).json()
    assert info["version"] == 0 and info["rows"] == 3
    latest = gw.get("/v1/datasets/pq").json()
    assert latest["rows"] == 1 and [h["version"] for h in latest["history"]] == [1, 0]
    assert latest["history"][1]["options"]["label_key"] == "label"
    assert gw.get("/v1/datasets/pq", params={"version": 7}).status_code == 404
    broken = gw.post("/v1/datasets/pq", files={"file": ("x.parquet", b"PAR1 nope")})
    assert broken.status_code == 422 and "Parquet" in broken.json()["detail"]


def test_upload_over_the_dataset_limit_is_413(gw):
    response = _upload(gw, "huge", b"x" * (1024 * 1024 + 1))
    assert response.status_code == 413 and "1 MiB" in response.json()["detail"]


def test_datasets_need_a_global_token(kafka, lake_root, tmp_path):
    with RunningGateway(gateway_config(kafka, lake_root, tmp_path / "s")) as gw:
        with gw.client("run-a-writer") as client:
            assert _upload(client, "d", _jsonl({"input": "a"})).status_code == 403
        with gw.client("reader-token") as client:
            assert _upload(client, "d", _jsonl({"input": "a"})).status_code == 403
            assert client.get("/v1/datasets/d").status_code == 404
