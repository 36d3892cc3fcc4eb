#!/usr/bin/env python3
"""`meshtrain tokenize` against the Python `tiktoken` package on the same text and machine.

  python3 scripts/tokenize_bench.py MESHTRAIN_BINARY [--mb 100]

Builds a text of about --mb MB from the Shakespeare corpus (repeated), tokenises it with GPT-2's
BPE through `meshtrain tokenize` (all cores) and through tiktoken — `encode_ordinary` on the
whole text (one thread, what most scripts call) and `encode_ordinary_batch` over 1 MB pieces
with as many threads as cores — checks that the token counts agree, and prints MB/s and the
ratios. tiktoken downloads its vocabulary at first use; with no network the script builds the
same encoding from the vocabulary file tiktoken-rs ships (found in ~/.cargo/registry).
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_encoding():
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2'), 'tiktoken gpt2'
    except Exception:
        files = glob.glob(os.path.expanduser(
            '~/.cargo/registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken'))
        if not files:
            sys.exit('tokenize_bench: no network for tiktoken and no r50k_base.tiktoken in '
                     '~/.cargo/registry (build meshtrain first)')
        from tiktoken.load import load_tiktoken_bpe
        enc = tiktoken.Encoding('gpt2-local', pat_str=GPT2_PATTERN,
                                mergeable_ranks=load_tiktoken_bpe(files[0]),
                                special_tokens={'<|endoftext|>': 50256})
        return enc, f'tiktoken gpt2 (vocabulary from {files[0]})'


def main():
    p = argparse.ArgumentParser()
    p.add_argument('meshtrain')
    p.add_argument('--mb', type=float, default=100.0)
    args = p.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
    corpus = open(os.path.join(root, 'data/shakespeare/input.txt'), encoding='utf-8').read()
    text = corpus * max(1, round(args.mb * 1e6 / len(corpus.encode())))
    size_mb = len(text.encode()) / 1e6
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'text.txt')
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
        out = subprocess.run([args.meshtrain, 'tokenize', '--input', path, '--out',
                              os.path.join(tmp, 'tok'), '--val-fraction', '0'],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r'^(\d+) tokens of .* \(([\d.]+) MB/s', out, re.M)
        ours_tokens, ours_mbs = int(m.group(1)) - 1, float(m.group(2))  # less the end-of-text
    enc, which = gpt2_encoding()
    t = time.perf_counter()
    whole = enc.encode_ordinary(text)
    single = size_mb / (time.perf_counter() - t)
    pieces = [text[i:i + len(corpus)] for i in range(0, len(text), len(corpus))]
    t = time.perf_counter()
    batch = enc.encode_ordinary_batch(pieces, num_threads=cores)
    threaded = size_mb / (time.perf_counter() - t)
    print(f'text: {size_mb:.1f} MB ({len(corpus.encode()) / 1e6:.2f} MB corpus repeated); '
          f'{cores} cores; {which}')
    print(f'meshtrain tokenize:                 {ours_mbs:8.1f} MB/s, {ours_tokens} tokens')
    print(f'tiktoken encode_ordinary (1 thread): {single:8.1f} MB/s, {len(whole)} tokens '
          f'-> meshtrain {ours_mbs / single:.2f}x')
    print(f'tiktoken encode_ordinary_batch ({cores} threads): {threaded:8.1f} MB/s, '
          f'{sum(map(len, batch))} tokens -> meshtrain {ours_mbs / threaded:.2f}x')
    if ours_tokens != len(whole):
        sys.exit(f'tokenize_bench: token counts differ: {ours_tokens} against {len(whole)}')


if __name__ == '__main__':
    main()
