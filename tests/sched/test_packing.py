"""Bin packing: the fast FFD must be the textbook FFD, and every packing must be valid."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.packing import (
    as_lengths,
    best_fit_decreasing,
    bin_ids,
    first_fit_decreasing,
    naive_first_fit_decreasing,
    pack_sequences,
    sorted_by_length,
)

FAST = settings(max_examples=150, deadline=None)


@st.composite
def lengths_and_capacity(draw, max_size: int = 60):
    """A capacity and lengths that fit it, including the edge cases of the contract."""
    capacity = draw(st.integers(min_value=1, max_value=200))
    length = st.integers(min_value=1, max_value=capacity)
    kind = draw(st.sampled_from(["random", "few distinct", "all equal", "at capacity"]))
    if kind == "few distinct":  # long runs of equal lengths: the bulk path of the fast FFD
        length = st.sampled_from(sorted({1, max(1, capacity // 3), max(1, capacity // 2)}))
    elif kind == "all equal":
        length = st.just(draw(length))
    elif kind == "at capacity":
        length = st.one_of(st.just(capacity), length)
    return draw(st.lists(length, min_size=0, max_size=max_size)), capacity


def textbook_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Longest first (ties by index), each into the fullest bin with room (ties: lowest bin)."""
    rooms: list[int] = []
    bins: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [b for b, room in enumerate(rooms) if room >= lengths[index]]
        if fitting:
            best = min(fitting, key=lambda b: (rooms[b], b))
        else:
            best = len(rooms)
            rooms.append(capacity)
            bins.append([])
        rooms[best] -= lengths[index]
        bins[best].append(index)
    return bins


def assert_valid_packing(bins: list[np.ndarray], lengths: list[int], capacity: int) -> None:
    members = np.concatenate(bins) if bins else np.zeros(0, dtype=np.int64)
    assert sorted(members.tolist()) == list(range(len(lengths))), "each sequence exactly once"
    for members_of_bin in bins:
        assert members_of_bin.size >= 1
        assert sum(lengths[i] for i in members_of_bin.tolist()) <= capacity


@FAST
@given(lengths_and_capacity())
def test_ffd_equals_textbook_ffd(case):
    lengths, capacity = case
    fast = first_fit_decreasing(lengths, capacity)
    # The textbook loop written out here, independent of the library's reference copy.
    rooms: list[int] = []
    textbook: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(rooms):
            if lengths[index] <= room:
                rooms[b] -= lengths[index]
                textbook[b].append(index)
                break
        else:
            rooms.append(capacity - lengths[index])
            textbook.append([index])
    assert [b.tolist() for b in fast] == textbook


@FAST
@given(lengths_and_capacity())
def test_library_reference_ffd_equals_fast_ffd(case):
    lengths, capacity = case
    fast = first_fit_decreasing(lengths, capacity)
    naive = naive_first_fit_decreasing(lengths, capacity)
    assert [b.tolist() for b in fast] == [b.tolist() for b in naive]


@FAST
@given(lengths_and_capacity())
def test_bfd_equals_textbook_bfd(case):
    lengths, capacity = case
    assert [b.tolist() for b in best_fit_decreasing(lengths, capacity)] == (
        textbook_best_fit_decreasing(lengths, capacity)
    )


@FAST
@given(lengths_and_capacity(), st.sampled_from(["ffd", "bfd"]))
def test_every_sequence_in_exactly_one_bin_within_capacity(case, method):
    lengths, capacity = case
    bins = pack_sequences(lengths, capacity, method=method)
    assert_valid_packing(bins, lengths, capacity)
    lower_bound = -(-sum(lengths) // capacity)
    assert len(bins) >= lower_bound


def test_packed_count_never_exceeds_naive_ffd_on_long_tailed_lengths():
    rng = np.random.default_rng(7)
    for _ in range(5):
        lengths = np.clip(np.round(rng.lognormal(np.log(800), 0.9, 400)), 1, 6000).astype(int)
        fast = first_fit_decreasing(lengths, 12_000)
        naive = naive_first_fit_decreasing(lengths, 12_000)
        assert len(fast) <= len(naive)
        assert_valid_packing(fast, lengths.tolist(), 12_000)


def test_ffd_packs_long_equal_runs_like_the_textbook():
    lengths = [3] * 500 + [4] * 300 + [10] * 50 + [1] * 7
    fast = first_fit_decreasing(lengths, 10)
    naive = naive_first_fit_decreasing(lengths, 10)
    assert [b.tolist() for b in fast] == [b.tolist() for b in naive]


def test_bins_hold_indices_longest_first():
    lengths = [2, 9, 4, 4, 7]
    for members in first_fit_decreasing(lengths, 11):
        member_lengths = [lengths[i] for i in members.tolist()]
        assert member_lengths == sorted(member_lengths, reverse=True)


def test_ffd_is_deterministic_and_ignores_input_container():
    lengths = [5, 3, 5, 2, 8, 3, 3]
    as_list = [b.tolist() for b in first_fit_decreasing(lengths, 10)]
    as_array = [b.tolist() for b in first_fit_decreasing(np.array(lengths, np.int32), 10)]
    assert as_list == as_array


def test_empty_input_gives_no_bins():
    assert first_fit_decreasing([], 10) == []
    assert best_fit_decreasing([], 10) == []


def test_one_sequence_at_capacity_fills_one_bin():
    assert [b.tolist() for b in pack_sequences([10], 10)] == [[0]]


@pytest.mark.parametrize("method", ["ffd", "bfd"])
def test_too_long_sequence_error_names_index_and_length(method):
    with pytest.raises(ValueError, match=r"sequence 2 has length 11, longer than the capacity 10"):
        pack_sequences([3, 10, 11, 12], 10, method=method)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 0, 2], "sequence 1 has length 0"),
        ([3, -4], "sequence 1 has length -4"),
        ([[1, 2]], "must be 1-D"),
        ([1.5, 2], "whole numbers"),
    ],
)
def test_bad_lengths_are_rejected(lengths, message):
    with pytest.raises(ValueError, match=message):
        as_lengths(lengths)


def test_bad_capacity_and_method_are_rejected():
    with pytest.raises(ValueError, match="capacity must be a whole number >= 1"):
        pack_sequences([1], 0)
    with pytest.raises(ValueError, match="unknown packing method 'nfd'"):
        pack_sequences([1], 4, method="nfd")


@FAST
@given(st.lists(st.integers(1, 50), max_size=80), st.booleans())
def test_sorted_by_length_orders_by_length_then_index(lengths, descending):
    order = sorted_by_length(np.asarray(lengths, dtype=np.int64), descending=descending)
    sign = -1 if descending else 1
    assert order.tolist() == sorted(range(len(lengths)), key=lambda i: (sign * lengths[i], i))


def test_sorted_by_length_survives_keys_that_would_overflow():
    huge = np.array([2**62, 5, 2**62, 1], dtype=np.int64)
    assert sorted_by_length(huge).tolist() == [3, 1, 0, 2]
    assert sorted_by_length(huge, descending=True).tolist() == [0, 2, 1, 3]


@FAST
@given(lengths_and_capacity())
def test_bin_ids_inverts_a_packing(case):
    lengths, capacity = case
    bins = pack_sequences(lengths, capacity)
    owner = bin_ids(bins, len(lengths))
    for bin_index, members in enumerate(bins):
        assert (owner[members] == bin_index).all()
    assert (owner >= 0).all()
