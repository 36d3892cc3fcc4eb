#!/usr/bin/env python3
"""Independent reference for rng.rs / batching.rs / text.rs golden tests.

Re-implements, from the published descriptions, SplitMix64 (Steele, Lea &
Flood 2014), Lemire's unbiased bounded integers and the Fisher-Yates shuffle,
with the same stream derivation as rng.rs, and prints the values the Rust
tests pin. Run: python3 crates/data/scripts/splitmix64_reference.py
"""
MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK

    @classmethod
    def derive(cls, seed, stream):
        return cls(seed ^ mix64((stream + GAMMA) & MASK))

    def next_u64(self):
        self.state = (self.state + GAMMA) & MASK
        return mix64(self.state)

    def below(self, bound):
        threshold = (-bound % (1 << 64)) % bound
        while True:
            product = self.next_u64() * bound
            if product & MASK >= threshold:
                return product >> 64

    def shuffle(self, items):
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]


if __name__ == "__main__":
    for seed in (0, 1234567):
        rng = SplitMix64(seed)
        print(f"SplitMix64({seed}) first 3:", [hex(rng.next_u64()) for _ in range(3)])
    order = list(range(10))
    SplitMix64.derive(1, 0).shuffle(order)
    print("EpochShuffler(len 10, seed 1).permutation(0):", order)
    rng = SplitMix64(2024)
    print("TextBatchSampler seed 2024, 1000 starts, first 4 offsets:", [rng.below(1000) for _ in range(4)])
