"""Fixtures shared by several test files."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process engine runs on a shared 2-core machine: two torch threads fighting other processes
    for the cores ran up to ~50x slower, so these modules run with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
