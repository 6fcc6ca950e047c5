"""The two sides of the weight hand-off race, run as separate processes by test_weights.py:

    python weights_race.py write DIR   # publishes versions 1..VERSIONS as fast as it can
    python weights_race.py read DIR    # loads until it saw the last; prints a JSON result

Every value of every tensor of version v is v, so a torn or mixed file cannot pass.
"""

from __future__ import annotations

import json
import sys

import torch
from rlfeed.service.learning.weights import WeightsPublisher, WeightsReader

VERSIONS = 300
# Tensors large enough that writing one version takes many write() calls (~1 MiB).
SHAPES = {"embed": (512, 256), "layer.weight": (256, 256), "layer.bias": (256,)}


def state_of(version: int) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, float(version)) for name, shape in SHAPES.items()}


def consistent(version: int, state: dict[str, torch.Tensor]) -> bool:
    return set(state) == set(SHAPES) and all(
        tuple(t.shape) == SHAPES[name] and bool((t == version).all()) for name, t in state.items()
    )


def write(directory: str) -> None:
    publisher = WeightsPublisher(directory, keep=2)  # deletes under the readers' feet too
    for version in range(1, VERSIONS + 1):
        publisher.publish(version, state_of(version))


def read(directory: str) -> None:
    reader = WeightsReader(directory)
    loads, bad, backwards, last = 0, [], 0, -1
    while last < VERSIONS:
        update = reader.poll()
        if update is None:
            continue
        version, state = update
        loads += 1
        if not consistent(version, state):
            bad.append(version)
        backwards += version <= last
        last = version
    print(json.dumps({"loads": loads, "inconsistent": bad, "backwards": backwards}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"write": write, "read": read}[sys.argv[1]](sys.argv[2])
