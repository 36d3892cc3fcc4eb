#!/usr/bin/env python3
"""Corpus files written by independent writers, for crates/meshtrain/tests/token_files.rs:
the same documents as a Parquet file (pyarrow: several row groups, a null row, an extra
column, zstd and snappy column chunks, a large_string and a string column), as gzip-compressed
JSON lines (Python's gzip and json), as zstd-compressed JSON lines (Arrow C++'s zstd codec,
in two frames), and as plain text files, plus the documents' GPT-2 ids as
tiktoken computes them (so the test also checks meshtrain's BPE against tiktoken's).

Writes into crates/meshtrain/tests/refs/corpus/:
  docs.snappy.parquet, docs.zstd.parquet   one document per row in "text" (row 3 is null)
  docs.jsonl.gz                            one JSON object per line ({"id", "text"})
  docs.jsonl.zst                           the same lines, zstd: two frames, cut after line 7
  text/doc_NN.txt                          each document as its own file
  ids.json                                 {"end_of_text": 50256, "documents": [[ids...], ...]}

Setup (PyPI only):
  python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tiktoken pyarrow
  /tmp/tokvenv/bin/python scripts/corpus_reference.py
(tiktoken downloads GPT-2's vocabulary at first use; offline, the vocabulary file tiktoken-rs
ships is used, as scripts/tokenize_bench.py does.)
"""
import gzip
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/meshtrain/tests/refs/corpus"


def documents():
    text = (ROOT / "data/shakespeare/input.txt").read_text(encoding="utf-8")
    # Twelve documents of uneven length, cut at arbitrary places (mid-word, mid-line), and two
    # of non-ASCII text: what a web corpus's rows look like.
    cuts = [0, 700, 1500, 1501, 4000, 4100, 6000, 9000, 9050, 12000, 15000]
    docs = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    docs.append("Ünïcödé — «quotes», 中文, emoji 🎭 and a tab\there.\n")
    docs.append("   leading spaces, trailing newlines\n\n\n")
    return docs


def main():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from tokenize_bench import gpt2_encoding  # tiktoken's GPT-2, offline if need be

    docs = documents()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "text").mkdir(exist_ok=True)
    for i, d in enumerate(docs):
        (OUT / "text" / f"doc_{i:02}.txt").write_text(d, encoding="utf-8")
    # Row 3 is null (skipped under --skip-bad), so the rows hold the same documents in order.
    rows = docs[:3] + [None] + docs[3:]
    table = pa.table({"id": list(range(len(rows))), "text": pa.array(rows, type=pa.large_string())})
    pq.write_table(table, OUT / "docs.zstd.parquet", row_group_size=4, compression="zstd")
    table = pa.table({"text": pa.array(rows, type=pa.string()), "id": list(range(len(rows)))})
    pq.write_table(table, OUT / "docs.snappy.parquet", row_group_size=5, compression="snappy")
    with gzip.open(OUT / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    lines = [json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)]
    frames = ["".join(lines[:7]), "".join(lines[7:])]
    (OUT / "docs.jsonl.zst").write_bytes(
        b"".join(pa.compress(f.encode("utf-8"), codec="zstd", asbytes=True) for f in frames))
    enc, source = gpt2_encoding()
    ids = [enc.encode_ordinary(d) for d in docs]
    eot = enc.encode("<|endoftext|>", allowed_special="all")[0]
    (OUT / "ids.json").write_text(json.dumps({"end_of_text": eot, "documents": ids, "by": source}))
    print(f"wrote {len(docs)} documents to {OUT}")


if __name__ == "__main__":
    main()
