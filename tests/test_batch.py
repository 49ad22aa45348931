"""Packed HDF5 batch files: the data plane between roles."""

import errno
import multiprocessing

import numpy as np
import pytest

from areal_hpc.data.batch import BatchError, gather, read_attrs, read_batch, read_keys, select, write_batch
from tests.helpers import CAN_REFUSE_FLOCK, refuse_flock


def toy_batch():
    # Three sequences of 3, 2 and 4 tokens.
    return {
        "cu_seqlens": np.array([0, 3, 5, 9]),
        "packed_input_ids": np.arange(9),
        "rewards": np.array([1.0, -1.0, 0.5], dtype=np.float32),
    }


def test_write_then_read_round_trips_arrays_and_attrs(tmp_path):
    path = write_batch(tmp_path / "step1" / "gen.h5", toy_batch(), {"step": 1, "version": 3})
    out = read_batch(path)
    assert out.keys() == toy_batch().keys()
    np.testing.assert_array_equal(out["packed_input_ids"], np.arange(9))
    assert read_attrs(path) == {"step": 1, "version": 3}
    assert [p.name for p in path.parent.iterdir()] == ["gen.h5"]  # no temporary file left


def test_select_repacks_sequences_in_the_given_order():
    out = select(toy_batch(), [2, 0])
    assert out["cu_seqlens"].tolist() == [0, 4, 7]
    assert out["packed_input_ids"].tolist() == [5, 6, 7, 8, 0, 1, 2]
    assert out["rewards"].tolist() == [0.5, 1.0]


def test_read_some_keys_of_some_sequences(tmp_path):
    path = write_batch(tmp_path / "b.h5", toy_batch())
    out = read_batch(path, keys=["rewards"], seqs=[1])
    assert out["rewards"].tolist() == [-1.0] and out["cu_seqlens"].tolist() == [0, 2]


def test_bad_batches_are_refused_with_the_key_named(tmp_path):
    with pytest.raises(BatchError, match="'rewards' has length 2"):
        write_batch(tmp_path / "b.h5", {**toy_batch(), "rewards": np.zeros(2)})
    with pytest.raises(BatchError, match="grow by >= 2 tokens"):
        write_batch(tmp_path / "b.h5", {"cu_seqlens": np.array([0, 1])})
    path = write_batch(tmp_path / "b.h5", toy_batch())
    with pytest.raises(BatchError, match=r"has no \['values'\]"):
        read_batch(path, keys=["values"])
    with pytest.raises(BatchError, match="out of range"):
        select(toy_batch(), [3])
    with pytest.raises(BatchError, match="does not exist"):
        read_batch(tmp_path / "missing.h5")


def test_gather_assembles_samples_from_several_files(tmp_path):
    gen = write_batch(tmp_path / "gen.h5", toy_batch())
    inf = write_batch(  # a trainer rank's output for sequences 2 and 0, in that order
        tmp_path / "inf.h5", {"cu_seqlens": np.array([0, 4, 7]), "proximal_logprobs": np.arange(7.0)}
    )
    out = gather(
        {
            "packed_input_ids": [(str(gen), 0), (str(gen), 2)],
            "rewards": [(str(gen), 0), (str(gen), 2)],
            "proximal_logprobs": [(str(inf), 1), (str(inf), 0)],
        }
    )
    assert out["cu_seqlens"].tolist() == [0, 3, 7]
    assert out["packed_input_ids"].tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert out["rewards"].tolist() == [1.0, 0.5]
    assert out["proximal_logprobs"].tolist() == [4.0, 5.0, 6.0, 0.0, 1.0, 2.0, 3.0]


def test_gather_numbers_the_groups_of_several_files_apart(tmp_path):
    # Two rollout-store files of one group each (group 0 in both), and a step file of two groups.
    one = write_batch(tmp_path / "a.h5", {**toy_batch(), "group_ids": np.array([0, 0, 0])})
    two = write_batch(tmp_path / "b.h5", {**toy_batch(), "group_ids": np.array([0, 0, 0])})
    step = write_batch(tmp_path / "c.h5", {**toy_batch(), "group_ids": np.array([0, 1, 1])})
    refs = [(str(one), 0), (str(two), 0), (str(one), 1), (str(step), 0), (str(step), 2), (str(step), 1)]
    out = gather({"packed_input_ids": refs, "group_ids": refs})
    assert out["group_ids"].tolist() == [0, 1, 0, 2, 3, 3]


def test_gather_refuses_misaligned_tokens(tmp_path):
    gen = write_batch(tmp_path / "gen.h5", toy_batch())
    other = write_batch(tmp_path / "other.h5", {"cu_seqlens": np.array([0, 3, 5]), "x": np.zeros(5)})
    with pytest.raises(BatchError, match="has 2 tokens, not 3"):
        gather({"packed_input_ids": [(str(gen), 0)], "rewards": [(str(gen), 1)], "x": [(str(other), 1)]})


def _write_and_read_where_locks_are_refused(path: str) -> None:
    refuse_flock(errno.ENOLCK)  # as NFS without a lock daemon does
    write_batch(path, toy_batch(), {"step": 1})
    assert read_batch(path, keys=["rewards"])["rewards"].tolist() == [1.0, -1.0, 0.5]
    assert read_attrs(path) == {"step": 1} and "rewards" in read_keys(path)


@pytest.mark.skipif(not CAN_REFUSE_FLOCK, reason="no seccomp filter for flock on this machine")
def test_batches_are_written_and_read_where_file_locks_are_refused(tmp_path):
    child = multiprocessing.get_context("spawn").Process(
        target=_write_and_read_where_locks_are_refused, args=(str(tmp_path / "b.h5"),)
    )
    child.start()
    child.join(120)
    assert child.exitcode == 0, "the batch file could not be written or read: see the child's error above"
