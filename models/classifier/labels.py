"""The classifier's 1000 class labels: distinct adjective-noun pairs, drawn with a fixed seed.

The weights are synthetic, so the labels are too; they only need to be stable
across builds and processes.
"""

from __future__ import annotations

import numpy as np

SEED = 1000
CLASSES = 1000

ADJECTIVES = (
    "amber", "ashen", "azure", "bold", "brisk", "bronze", "calm", "cobalt", "copper", "crimson",
    "dusky", "eager", "emerald", "fierce", "gentle", "gilded", "golden", "hollow", "icy", "ivory",
    "jade", "keen", "lively", "lunar", "misty", "mossy", "nimble", "ochre", "pale", "proud",
    "quiet", "rapid", "russet", "scarlet", "silent", "silver", "sleek", "solar", "swift", "tawny",
)  # fmt: skip
NOUNS = (
    "badger", "beacon", "bison", "canyon", "cedar", "comet", "crane", "delta", "ember", "falcon",
    "fern", "fjord", "glacier", "harbor", "heron", "island", "jaguar", "kestrel", "lantern", "lynx",
    "meadow", "otter", "owl", "pebble", "quarry", "raven", "reef", "river", "sparrow", "summit",
    "thicket", "willow",
)  # fmt: skip


def make_labels(count: int = CLASSES, seed: int = SEED) -> tuple[str, ...]:
    """``count`` distinct labels in a seeded order; at most len(ADJECTIVES) * len(NOUNS)."""
    pairs = len(ADJECTIVES) * len(NOUNS)
    if not 0 <= count <= pairs:
        raise ValueError(f"count: must be in [0, {pairs}], got {count}")
    picks = np.random.default_rng(seed).permutation(pairs)[:count]
    return tuple(f"{ADJECTIVES[i // len(NOUNS)]} {NOUNS[i % len(NOUNS)]}" for i in picks)


LABELS = make_labels()
