"""The docstring examples of the cache package run as written."""

import doctest

import pytest

from specdec.cache import block_pool, block_table, metadata


@pytest.mark.parametrize("module", [block_pool, block_table, metadata], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
