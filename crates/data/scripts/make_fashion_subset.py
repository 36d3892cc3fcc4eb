#!/usr/bin/env python3
"""Cut the balanced Fashion-MNIST subset that ships in data/fashion-mnist-subset/.

Deterministic: the first TRAIN_PER_CLASS training images of every class, in
file order, plus the complete 10,000-image test set. Output is standard IDX
.gz (same format as the originals) so one parser reads both; gzip headers
carry no file name and mtime 0, so the same zlib gives byte-identical files.

The loader checks the SHA-256 of the *decompressed* payload, never of the .gz
bytes (Debian re-compresses the originals, so .gz digests differ by source).

Usage (standard library only):
    python3 crates/data/scripts/make_fashion_subset.py \
        [--src /usr/share/datasets/fashion-mnist] [--out data/fashion-mnist-subset]
Prints the four payload SHA-256 digests to paste into crates/data/src/fashion.rs.
"""
import argparse
import gzip
import hashlib
import os
import struct

TRAIN_PER_CLASS = 1200
NUM_CLASSES = 10

# SHA-256 of the decompressed official files (same table as fashion.rs).
FULL_SHA256 = {
    "train-images-idx3-ubyte.gz": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte.gz": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte.gz": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte.gz": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}


def read_verified(src, name):
    payload = gzip.decompress(open(os.path.join(src, name), "rb").read())
    digest = hashlib.sha256(payload).hexdigest()
    if digest != FULL_SHA256[name]:
        raise SystemExit(f"{name}: SHA-256 {digest} is not the official payload")
    return payload


def write_gz(path, payload):
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(payload)
    return hashlib.sha256(payload).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--out", default="data/fashion-mnist-subset")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    images = read_verified(args.src, "train-images-idx3-ubyte.gz")
    labels = read_verified(args.src, "train-labels-idx1-ubyte.gz")
    _, count, rows, cols = struct.unpack(">IIII", images[:16])
    pixels = rows * cols
    taken = [0] * NUM_CLASSES
    chosen = []
    for index in range(count):
        label = labels[8 + index]
        if taken[label] < TRAIN_PER_CLASS:
            taken[label] += 1
            chosen.append(index)
    assert taken == [TRAIN_PER_CLASS] * NUM_CLASSES, taken
    n = len(chosen)
    sub_images = bytearray(struct.pack(">IIII", 0x00000803, n, rows, cols))
    sub_labels = bytearray(struct.pack(">II", 0x00000801, n))
    for index in chosen:
        start = 16 + index * pixels
        sub_images += images[start : start + pixels]
        sub_labels.append(labels[8 + index])

    outputs = {
        "train-images-idx3-ubyte.gz": bytes(sub_images),
        "train-labels-idx1-ubyte.gz": bytes(sub_labels),
        # The full test set: accuracy stays comparable with published numbers.
        "t10k-images-idx3-ubyte.gz": read_verified(args.src, "t10k-images-idx3-ubyte.gz"),
        "t10k-labels-idx1-ubyte.gz": read_verified(args.src, "t10k-labels-idx1-ubyte.gz"),
    }
    for name, payload in outputs.items():
        digest = write_gz(os.path.join(args.out, name), payload)
        size = os.path.getsize(os.path.join(args.out, name))
        print(f"{name}  {size:>9} B  payload sha256 {digest}")


if __name__ == "__main__":
    main()
