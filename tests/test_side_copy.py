"""The grammar bitmask's copies to the GPU on a side stream (``fill_worker.SideCopy``): the compute stream
reads the copied rows only after the copy, and a copy into the masked heads' static bitmask starts only
after the compute stream's last read of it. Each check holds one of the two streams back with a spin
kernel, so a missing wait reads the wrong rows."""
from __future__ import annotations

import pytest
import torch

from nbgen.runtime.fill_worker import DeviceBitmask, FillJob, SideCopy

SPIN = 200_000_000      # GPU cycles (~0.1 s): long enough that an unordered read or write wins the race


def test_side_copy_on_the_cpu_copies_in_place_of_a_stream():
    host = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    got = FillJob([0, 1, 2], host, None, 128).on_device(2, torch.device("cpu"), SideCopy())
    assert torch.equal(got, host[:2])


@pytest.mark.gpu
def test_compute_stream_waits_for_the_side_copy():
    dev = torch.device("cuda")
    host = torch.randint(-2**31, 2**31 - 1, (256, 4748), dtype=torch.int32).pin_memory()
    side = SideCopy()

    def slow_copy() -> torch.Tensor:
        torch.cuda._sleep(SPIN)                  # the side stream is busy before the copy
        return host.to(dev, non_blocking=True)

    out = side.run(dev, slow_copy)
    out.record_stream(torch.cuda.current_stream(dev))
    seen = out.clone()                           # queued on the compute stream: must wait for the copy
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), host)
    job = FillJob(list(range(256)), host, None, 151_936)
    for _ in range(3):                           # reuse of the side stream's blocks across steps
        assert torch.equal(job.on_device(200, dev, side).clone().cpu(), host[:200])


@pytest.mark.gpu
def test_device_bitmask_copy_waits_for_the_last_read():
    dev = torch.device("cuda")
    bm = DeviceBitmask(64, 64 * 32, dev)
    old = torch.randint(-2**31, 2**31 - 1, (64, 64), dtype=torch.int32)
    new = torch.randint(-2**31, 2**31 - 1, (64, 64), dtype=torch.int32).pin_memory()
    bm.words.copy_(old.to(dev))
    torch.cuda._sleep(SPIN)                      # the compute stream's read of the buffer comes late
    seen = bm.words.clone()
    bm.mark_read()
    got = bm.copy_in(new, 64 * 32)
    after = got.clone()                          # the compute stream reads the new rows
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), old)          # the copy did not overtake the earlier read
    assert torch.equal(after.cpu(), new)
