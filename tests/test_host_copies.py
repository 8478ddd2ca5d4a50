"""Loads' staged host-to-device copies (`HostCopies`): the chunking, dtype conversion and
error handling run on CPU with the staging forced on; the GPU path is in test_gpu.py."""
import pytest
import torch

from raypar.runtime.host_copies import HostCopies, host_copies

CPU = torch.device("cpu")


def pairs():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(1000, 37, generator=g), torch.randn(5, generator=g), torch.randn(1, generator=g),
           torch.randn(33, 3, generator=g).to(torch.bfloat16), torch.randn(4097, generator=g)]
    dst = [torch.empty(37000), torch.empty(5, dtype=torch.bfloat16), torch.empty(()),
           torch.empty(99, dtype=torch.float32), torch.empty(4097, dtype=torch.float64)]
    return dst, src


def test_staged_copies_equal_plain_ones_across_chunks_shapes_and_dtypes():
    dst, src = pairs()
    # 4 KiB chunks: the big tensor is cut into many, more than the queue holds at once.
    with host_copies(CPU, threads=3, chunk_bytes=4096, staged=True) as copies:
        for d, s in zip(dst, src):
            copies.copy(d, s)
    assert copies.staged_bytes == sum(s.nbytes for s in src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.reshape(d.shape).to(d.dtype))


def test_a_destination_that_cannot_be_staged_is_copied_at_once():
    base = torch.zeros(8, 8)
    column = base[:, 1]  # not contiguous
    copies = HostCopies(CPU, threads=2, staged=True)
    copies.copy(column, torch.arange(8.0))
    assert torch.equal(base[:, 1], torch.arange(8.0))  # before wait: done in the caller's thread
    assert copies.staged_bytes == 0
    copies.wait()


def test_a_size_mismatch_is_an_error_at_the_call():
    copies = HostCopies(CPU, threads=1, staged=True)
    with pytest.raises(ValueError, match="copying 6 elements into 4"):
        copies.copy(torch.empty(4), torch.empty(2, 3))
    copies.wait()


class FailingOnThird(HostCopies):
    def __init__(self, *args, **kwargs):
        self.seen = 0
        super().__init__(*args, **kwargs)

    def _copy_chunk(self, dst, src, *rest):
        self.seen += 1
        if self.seen == 3:
            raise RuntimeError("the bus fell over")
        super()._copy_chunk(dst, src, *rest)


def test_a_failed_chunk_is_raised_by_wait_or_the_next_copy_without_hanging():
    copies = FailingOnThird(CPU, threads=1, chunk_bytes=64, staged=True)
    dst, src = torch.empty(1000), torch.randn(1000)  # 63 chunks of 16 floats
    with pytest.raises(RuntimeError, match="the bus fell over"):
        copies.copy(dst, src)
        copies.copy(dst, src)
        copies.wait()
    with pytest.raises(RuntimeError, match="the bus fell over"):
        copies.wait()  # the error stays; the stagers have drained and stopped
    assert copies._threads == []


def test_an_error_in_the_block_stops_the_stagers_and_is_the_one_raised():
    with pytest.raises(KeyError, match="missing"):
        with host_copies(CPU, threads=2, chunk_bytes=64, staged=True) as copies:
            copies.copy(torch.empty(100), torch.randn(100))
            raise KeyError("missing")
    assert copies._threads == []


def test_unstaged_copies_happen_at_the_call():
    copies = HostCopies(CPU)  # a CPU device: nothing to stage
    assert not copies.staged
    d = torch.empty(3)
    copies.copy(d, torch.tensor([[1.0, 2.0, 3.0]]))
    assert d.tolist() == [1.0, 2.0, 3.0]
    copies.wait()
