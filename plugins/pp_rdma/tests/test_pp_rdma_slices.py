"""Large reads through real Mooncake: split into concurrent slices, every byte where it belongs."""

from __future__ import annotations

from typing import Any

import pytest
from titan_pp_rdma.probe import probe_mooncake

MOONCAKE = probe_mooncake()
pytestmark = pytest.mark.skipif(not MOONCAKE.available, reason=MOONCAKE.detail)


def sliced_task(sizes: list[int]) -> dict[str, Any]:
    """Rank 0 sends random bytes of each size to rank 1 (and gets them back): what landed, and
    how many Mooncake transfers each read took."""
    import torch
    from megatron.core import parallel_state as ps
    from titan_pp_rdma import session
    from titan_pp_rdma.settings import PPRdmaSettings
    from titan_pp_rdma.wire import BWD, FWD

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(pp=2)
    rank = ps.get_pipeline_model_parallel_rank()
    settings = PPRdmaSettings(backend="mooncake", protocol="tcp", timeout_s=30.0)
    transport = session.open_session(ps.get_pipeline_model_parallel_group(), settings).transport
    engine = session.STATE.engine._te
    submitted: list[int] = []
    real = engine.batch_transfer_async_read

    class Counting:  # the pybind object's methods cannot be replaced: wrap the engine
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def batch_transfer_async_read(self, *args: Any) -> Any:
            submitted.append(args[3][0])
            return real(*args)

    session.STATE.engine._te = Counting()
    landed, slices = [], []
    try:
        for nbytes in sizes:
            sent = torch.randint(
                0,
                256,
                (nbytes,),
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(nbytes),
            )
            got = torch.zeros(nbytes, dtype=torch.uint8)
            submitted.clear()
            if rank == 0:
                transport.isend(sent, 1, FWD).wait()
                transport.irecv(got, 1, BWD).wait()
            else:
                transport.irecv(got, 0, FWD).wait()
                transport.isend(got, 0, BWD).wait()
            landed.append(bool(torch.equal(got, sent)))
            slices.append(list(submitted))
    finally:
        session.STATE.engine._te = engine
        session.reset()
    return {"landed": landed, "slices": slices}


def test_large_reads_go_out_as_slices_and_land_whole(gloo_pool2: Any) -> None:
    from titan_pp_rdma.mooncake_engine import MAX_SLICES, SLICE_BYTES

    uneven = 2 * SLICE_BYTES + 12  # two slices of SLICE_BYTES + 6
    sizes = [SLICE_BYTES, uneven, MAX_SLICES * SLICE_BYTES + 4]
    for rank in gloo_pool2.run(sliced_task, sizes, timeout=180):
        assert rank["landed"] == [True, True, True]
        one, two, many = rank["slices"]
        assert one == [SLICE_BYTES]  # below twice the slice size: one transfer
        assert sum(two) == uneven and len(two) == 2
        assert sum(many) == sizes[2] and len(many) == MAX_SLICES
