"""Weight hand-off: a reader never loads a torn or mixed-version checkpoint, even while a
writer publishes versions as fast as it can (separate processes, as trainer and producers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlfeed.service.learning.weights import (
    WeightsPublisher,
    WeightsReader,
    read_weights,
    versioned_name,
    write_atomically,
)

sys.path.insert(0, str(Path(__file__).parent))
from weights_race import VERSIONS, consistent, state_of


def test_readers_racing_a_writer_only_ever_load_whole_versions(tmp_path):
    WeightsPublisher(tmp_path).publish(0, state_of(0))
    script = [sys.executable, str(Path(__file__).with_name("weights_race.py"))]
    readers = [
        subprocess.Popen([*script, "read", str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    writer = subprocess.run([*script, "write", str(tmp_path)], timeout=120, check=True)
    assert writer.returncode == 0
    for reader in readers:
        out, _ = reader.communicate(timeout=60)
        assert reader.returncode == 0
        result = json.loads(out)
        print(f"reader: {result['loads']} loads of {VERSIONS} versions")
        assert result["loads"] > 5  # it really raced the writer (polled between versions)
        assert result["inconsistent"] == [] and result["backwards"] == 0
    assert sorted(os.listdir(tmp_path)) == [versioned_name(VERSIONS - 1), versioned_name(VERSIONS)]


def test_a_torn_file_is_what_the_check_would_catch(tmp_path):
    """The test above can fail: a half-written checkpoint does not load as a whole one."""
    path = tmp_path / "whole.pt"
    write_atomically(path, 7, state_of(7))
    data = path.read_bytes()
    torn = tmp_path / versioned_name(8)
    torn.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception):  # noqa: B017 (torch's error type for a truncated zip)
        read_weights(torn)
    version, state = read_weights(path)
    assert version == 7 and consistent(7, state)
    assert not consistent(7, {**state, "layer.bias": torch.full((256,), 8.0)})  # mixed


def test_reader_sees_nothing_before_the_first_version_and_each_version_once(tmp_path):
    reader = WeightsReader(tmp_path / "weights")
    assert reader.poll() is None  # no directory yet
    publisher = WeightsPublisher(tmp_path / "weights")
    assert reader.poll() is None  # nothing published
    publisher.publish(0, state_of(0))
    version, state = reader.poll()
    assert version == 0 and consistent(0, state)
    assert reader.poll() is None  # nothing newer
    publisher.publish(1, state_of(1))
    publisher.publish(2, state_of(2))
    assert reader.poll()[0] == 2  # the newest, skipping what it missed
    assert reader.version == 2


def test_a_file_whose_name_and_content_disagree_is_an_error(tmp_path):
    write_atomically(tmp_path / versioned_name(5), 4, state_of(4))
    with pytest.raises(ValueError, match="holds version 4"):
        WeightsReader(tmp_path).poll()
