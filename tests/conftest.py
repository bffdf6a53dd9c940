"""Fixtures shared by the multi-rank tests: pools of gloo ranks, one per test module."""

import pytest

from tests.dist_utils import DistPool


def _pool(size):
    pool = DistPool(size)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool4():
    yield from _pool(4)
