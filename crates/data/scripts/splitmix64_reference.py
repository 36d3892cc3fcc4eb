#!/usr/bin/env python3
"""Independent SplitMix64 reference (Steele, Lea & Flood 2014) for rng.rs tests."""
MASK = (1 << 64) - 1


def splitmix64(seed, count):
    state = seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        yield z ^ (z >> 31)


if __name__ == "__main__":
    for seed in (0, 1234567):
        print(seed, [hex(v) for v in splitmix64(seed, 3)], list(splitmix64(seed, 3)))
