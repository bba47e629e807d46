"""The object classes the detector knows: one shape, one size and one colour each.

Shared by the scene generator (what to draw) and the network builder (what to look
for). Colours are bright and saturated, far from the ground and from each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Shape = Literal["square", "disc"]


@dataclass(frozen=True)
class ObjectClass:
    label: str
    shape: Shape
    size_px: int  # side of the square, or diameter of the disc
    rgb: tuple[int, int, int]


CLASSES: tuple[ObjectClass, ...] = (
    ObjectClass("red square", "square", 24, (225, 30, 35)),
    ObjectClass("yellow disc", "disc", 32, (245, 215, 25)),
    ObjectClass("cyan square", "square", 40, (25, 215, 235)),
    ObjectClass("white disc", "disc", 28, (248, 248, 248)),
)
LABELS: tuple[str, ...] = tuple(c.label for c in CLASSES)
