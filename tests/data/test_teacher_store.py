"""Reading one sample's stored teacher embeddings (``TeacherSpec.read``): the header-keyed fast path gives
``np.load``'s array bit for bit, in its stored dtype, and every malformed member is still a bad sample."""

from __future__ import annotations

import io

import numpy as np
import pytest

from megabatch.data.teacher_store import TeacherSpec, encode_embeddings

WIDTH = 6


def npy(array: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("members", [1, 3])
def test_the_fast_path_reads_what_np_load_reads_in_the_stored_dtype(dtype, members):
    spec = TeacherSpec("teacher.npy", members, WIDTH, (10.0,) * members)
    rng = np.random.default_rng(members)
    arrays = [rng.standard_normal((members, 2, WIDTH)).astype(dtype) for _ in range(5)]
    read = [spec.read({"teacher.npy": encode_embeddings(a)}) for a in arrays]
    assert len(spec.headers) == 1  # the first sample's header, then no parsing
    for array, got in zip(arrays, read, strict=True):
        assert got.dtype == dtype and got.shape == (members, 2, WIDTH)
        np.testing.assert_array_equal(got, array)
    if members == 1:  # a single teacher stored as [2, width]
        two = rng.standard_normal((2, WIDTH)).astype(dtype)
        for _ in range(2):
            np.testing.assert_array_equal(spec.read({"teacher.npy": npy(two)}), two[None])


def test_malformed_members_are_bad_on_the_fast_path_too():
    spec = TeacherSpec("teacher.npy", 1, WIDTH, (10.0,))
    good = np.ones((1, 2, WIDTH), np.float16)
    assert spec.read({"teacher.npy": npy(good)}).dtype == np.float16  # the header is known from here on
    truncated = npy(good)[:-2]
    nan = good.copy()
    nan[0, 1, 2] = np.nan
    assert spec.read({"teacher.npy": truncated}) == "bad"
    assert spec.read({"teacher.npy": npy(nan)}) == "bad"
    assert spec.read({"teacher.npy": npy(np.ones((1, 2, WIDTH + 1), np.float16))}) == "bad"  # another width
    assert spec.read({"teacher.npy": npy(np.ones((1, 2, WIDTH), np.int16))}) == "bad"  # not floating point
    assert spec.read({"teacher.npy": b"not an npy"}) == "bad"
    assert spec.read({}) is None
    fortran = np.asfortranarray(np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH))
    np.testing.assert_array_equal(spec.read({"teacher.npy": npy(fortran)}), fortran[None])


def test_the_spec_compares_without_its_headers_and_pickles():
    import pickle

    spec = TeacherSpec("teacher.npy", 1, WIDTH, (10.0,))
    spec.read({"teacher.npy": encode_embeddings(np.zeros((1, 2, WIDTH), np.float16))})
    assert spec == TeacherSpec("teacher.npy", 1, WIDTH, (10.0,))
    assert pickle.loads(pickle.dumps(spec)) == spec
