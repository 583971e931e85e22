"""Writes the Hub data set fixtures of tests/it/hub_data.rs (tests/fixtures/hub_data/), each
parquet file beside a JSON lines file holding the same rows:

  alpaca/data/train-00000-of-00002.parquet   rows 0-29 of recipes/data/tiny-alpaca.jsonl, snappy
  alpaca/data/train-00001-of-00002.parquet   rows 30-53, zstd
  alpaca/data/test-00000-of-00001.parquet    rows 54-59, uncompressed
  alpaca.jsonl, alpaca-test.jsonl            the same rows (train, test)
      columns renamed as many Hub sets name them: question, context, answer (the recipe maps
      them with data.columns); row groups of 8 rows, so files span several.
  sharegpt/train.parquet, sharegpt.jsonl     rows 0-19 of recipes/data/tiny-chat.jsonl in the
      ShareGPT layout: conversations: list<struct<from, value>> (human / gpt / system)
  bad/nulls.parquet                          alpaca rows 0-5 with answer null in rows 2 and 5

Run: /opt/pyref/bin/python scripts/make_hub_data.py   (pyarrow; the output is deterministic)
"""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/hub_data"
ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def rows(name):
    with open(ROOT / "recipes/data" / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def write(path, table, compression):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression=compression, row_group_size=8)


def jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    alpaca = [
        {"question": r["instruction"], "context": r["input"], "answer": r["output"]}
        for r in rows("tiny-alpaca.jsonl")
    ]
    schema = pa.schema([("question", pa.string()), ("context", pa.string()), ("answer", pa.string())])
    parts = [
        ("alpaca/data/train-00000-of-00002.parquet", alpaca[:30], "snappy"),
        ("alpaca/data/train-00001-of-00002.parquet", alpaca[30:54], "zstd"),
        ("alpaca/data/test-00000-of-00001.parquet", alpaca[54:], "none"),
    ]
    for name, part, codec in parts:
        write(OUT / name, pa.Table.from_pylist(part, schema=schema), codec)
    jsonl(OUT / "alpaca.jsonl", alpaca[:54])
    jsonl(OUT / "alpaca-test.jsonl", alpaca[54:])

    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    chats = [
        {"conversations": [{"from": ROLE[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in rows("tiny-chat.jsonl")[:20]
    ]
    table = pa.Table.from_pylist(chats, schema=pa.schema([("conversations", pa.list_(turn))]))
    write(OUT / "sharegpt/train.parquet", table, "snappy")
    jsonl(OUT / "sharegpt.jsonl", chats)

    bad = [dict(r) for r in alpaca[:6]]
    for i in (2, 5):
        bad[i]["answer"] = None
    write(OUT / "bad/nulls.parquet", pa.Table.from_pylist(bad, schema=schema), "snappy")


if __name__ == "__main__":
    main()
