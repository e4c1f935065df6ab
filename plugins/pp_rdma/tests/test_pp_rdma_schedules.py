"""Tiny MoE GPT through megatron-core's unmodified pipeline schedules, with pp_rdma on.

Every run is compared bit for bit (losses, grad norms, every gradient of every rank) with the
plain gloo P2P reference of the same layout, run with the settings upstream gets right
(``batch_p2p_comm=False``, ``deallocate_pipeline_outputs=False``). The plugin runs use the
settings upstream gets wrong (batched P2P under PP=2+VPP; overlap + pseudo-free of outputs).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from titan_pp_rdma.probe import probe_mooncake

STEPS, MICROBATCHES = 2, 4
MOONCAKE = probe_mooncake()
needs_mooncake = pytest.mark.skipif(not MOONCAKE.available, reason=MOONCAKE.detail)
TORCH_ENV = {"TITAN_PP_RDMA_BACKEND": "torch"}
# The tiny GPT's pipeline tensors (16 x 2 x 64 float32, 8 KiB) would travel inline by default:
# INLINE_BYTES=0 sends every one through a Mooncake read, the path device tensors take.
MOONCAKE_ENV = {
    "TITAN_PP_RDMA_BACKEND": "mooncake",
    "TITAN_PP_RDMA_TIMEOUT_S": "60",
    "TITAN_PP_RDMA_INLINE_BYTES": "0",
}
INLINE_ENV = {**MOONCAKE_ENV, "TITAN_PP_RDMA_INLINE_BYTES": "64K"}
RING_ENV = {**MOONCAKE_ENV, "TITAN_PP_RDMA_BUFFERS": "ring"}  # the RDMA default, over TCP here


def train_task(pp: int, vpp: int | None, env: dict | None, **config: Any) -> dict:
    """One rank: build the tiny GPT for (pp, vpp), train, return losses / norms / grads."""
    from titan_pp_rdma import effects
    from titan_pp_rdma.report import report

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    effects.reset()

    tiny_gpt.init_parallel(pp=pp, vpp=vpp)
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    active = plugin_active("pp_rdma", env=env) if env is not None else contextlib.nullcontext()
    with active:
        patched = (
            getattr(schedules.P2PCommunicator, "titan_plugin", None) == "pp_rdma"
            and p2p_communication._batched_p2p_ops.__module__ == "titan_pp_rdma.torch_p2p"
        )
        cfg = tiny_gpt.make_config(**config)
        chunks = tiny_gpt.build_model(cfg, vpp=vpp)
        losses, norms = tiny_gpt.train(chunks, cfg, steps=STEPS, num_microbatches=MICROBATCHES)
        state = report() if env is not None else {}
        from titan_pp_rdma.session import STATE

        spins = [getattr(x.transport, "spin_s", None) for x in STATE.sessions.values()]
    grads = {k: v for k, v in tiny_gpt.state_snapshot(chunks).items() if k.endswith(".grad")}
    assert patched == (env is not None), "plugin patches not applied as expected"
    assert getattr(schedules.P2PCommunicator, "titan_plugin", None) is None, "patch not undone"
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "backend": state.get("backend"),
        "report": state,
        "effects": effects.effects(),
        "spin_s": [x for x in spins if x is not None],
    }


def mooncake_absent_task(pp: int, vpp: int | None, **config: Any) -> dict:
    """``train_task`` with ``mooncake`` made unimportable in this worker (then restored)."""
    import sys

    from titan_pp_rdma import session
    from titan_pp_rdma.report import doctor_checks

    names = ("mooncake", "mooncake.engine")
    saved_modules = {name: sys.modules.get(name) for name in names}
    saved_engine = (session.STATE.engine, session.STATE.engine_error)
    session.reset()
    session.STATE.engine, session.STATE.engine_error = None, ""
    sys.modules.update(dict.fromkeys(names))  # a None entry makes `import` raise ImportError
    try:
        result = train_task(pp, vpp, {"TITAN_PP_RDMA_BACKEND": "auto"}, **config)
        result["doctor"] = [check.as_dict() for check in doctor_checks()]
    finally:
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        session.reset()
        session.STATE.engine, session.STATE.engine_error = saved_engine
    return result


def closed_registry_task() -> int:
    """Close this worker's sessions; the regions the process-wide engine still holds."""
    from titan_pp_rdma import session

    session.reset()
    engine = session.STATE.engine
    return engine.registered_regions() if engine is not None else -1


REFERENCE = dict(batch_p2p_comm=False, deallocate_pipeline_outputs=False)
BATCHED = dict(batch_p2p_comm=True, deallocate_pipeline_outputs=True)
OVERLAP = dict(batch_p2p_comm=False, overlap_p2p_comm=True, deallocate_pipeline_outputs=True)


def assert_identical(runs: list[dict], ref: list[dict], what: str) -> None:
    """Rank by rank: same losses, grad norms and gradients, bit for bit."""
    for rank, (got, exp) in enumerate(zip(runs, ref, strict=True)):
        assert got["losses"] == exp["losses"], f"{what}: rank {rank} losses differ"
        assert got["norms"] == exp["norms"], f"{what}: rank {rank} grad norms differ"
        assert got["grads"].keys() == exp["grads"].keys()
        for name, grad in exp["grads"].items():
            assert got["grads"][name].equal(grad), f"{what}: rank {rank} grad {name} differs"


def _run(pool: Any, pp: int, vpp: int | None, env: dict | None, cfg: dict) -> list[dict]:
    return pool.run(train_task, pp, vpp, env, **cfg, timeout=240)


@needs_mooncake
def test_pp2_1f1b_mooncake_bit_identical(gloo_pool2: Any) -> None:
    ref = _run(gloo_pool2, 2, None, None, dict(batch_p2p_comm=True))
    got = _run(gloo_pool2, 2, None, MOONCAKE_ENV, BATCHED)
    assert [r["backend"] for r in got] == ["mooncake", "mooncake"]
    assert ref[1]["losses"] and len(ref[1]["losses"]) == STEPS
    # Measured after the run: every pipeline tensor (activations into rank 1, gradients into
    # rank 0: one per microbatch and step, 16 x 2 x 64 float32) arrived by a Mooncake read.
    moved = STEPS * MICROBATCHES
    for rank in got:
        assert rank["effects"] == {"read_messages": moved, "read_bytes": moved * 8192}
    assert_identical(got, ref, "PP=2 1F1B over Mooncake")


@needs_mooncake
def test_pp2_vpp2_mooncake_fixes_batched_order_and_overlap_free(gloo_pool2: Any) -> None:
    ref = _run(gloo_pool2, 2, 2, None, REFERENCE)
    # The hazard is real: upstream's batched order swaps activations and gradients here.
    upstream = _run(gloo_pool2, 2, 2, None, dict(batch_p2p_comm=True))
    assert upstream[1]["losses"] != ref[1]["losses"], "upstream batched PP=2+VPP order is fixed?"
    assert_identical(_run(gloo_pool2, 2, 2, MOONCAKE_ENV, BATCHED), ref, "VPP batched, Mooncake")
    assert_identical(_run(gloo_pool2, 2, 2, MOONCAKE_ENV, OVERLAP), ref, "VPP overlap, Mooncake")
    assert_identical(
        _run(gloo_pool2, 2, 2, MOONCAKE_ENV, REFERENCE), ref, "VPP unbatched, Mooncake"
    )
    inline = _run(gloo_pool2, 2, 2, INLINE_ENV, OVERLAP)
    assert all(set(r["effects"]) == {"inline_messages", "inline_bytes"} for r in inline)
    assert all(r["spin_s"] == [pytest.approx(100e-6)] for r in inline)  # SPIN_US default
    assert_identical(inline, ref, "VPP overlap, inline")
    variable = dict(BATCHED, variable_seq_lengths=True)  # shapes exchanged per message
    assert_identical(_run(gloo_pool2, 2, 2, MOONCAKE_ENV, variable), ref, "VPP variable seq")
    ring = _run(gloo_pool2, 2, 2, RING_ENV, OVERLAP)
    assert "ring buffers" in ring[0]["report"]["why"]
    assert_identical(ring, ref, "VPP overlap, Mooncake ring buffers")
    # Closing gives every slot back: the engine outlives sessions, and a stale region at an
    # address the allocator recycles fails the next session's registration.
    assert gloo_pool2.run(closed_registry_task) == [0, 0]


def test_pp2_vpp2_torch_fallback_fixes_both_hazards(gloo_pool2: Any) -> None:
    ref = _run(gloo_pool2, 2, 2, None, REFERENCE)
    batched = _run(gloo_pool2, 2, 2, TORCH_ENV, BATCHED)
    assert [r["backend"] for r in batched] == ["torch", "torch"]
    for rank in batched:  # VPP=2: two chunks' tensors per microbatch and step, all by torch
        assert set(rank["effects"]) == {"torch_messages", "torch_bytes"}
        assert rank["effects"]["torch_bytes"] == rank["effects"]["torch_messages"] * 8192 > 0
    assert_identical(batched, ref, "VPP batched, torch fallback")
    assert_identical(_run(gloo_pool2, 2, 2, TORCH_ENV, OVERLAP), ref, "VPP overlap, torch")


@needs_mooncake
def test_pp4_mooncake_bit_identical(gloo_pool4: Any) -> None:
    ref = _run(gloo_pool4, 4, None, None, REFERENCE)
    assert_identical(_run(gloo_pool4, 4, None, MOONCAKE_ENV, BATCHED), ref, "PP=4 over Mooncake")


def test_mooncake_absent_falls_back_and_reports(gloo_pool2: Any) -> None:
    ref = _run(gloo_pool2, 2, 2, None, REFERENCE)
    got = gloo_pool2.run(mooncake_absent_task, 2, 2, **OVERLAP, timeout=240)
    for rank in got:
        assert rank["report"]["backend"] == "torch" and rank["report"]["active"]
        assert "mooncake is not installed" in rank["report"]["why"]
        mooncake_check = next(c for c in rank["doctor"] if c["name"] == "pp_rdma.mooncake")
        assert mooncake_check["status"] == "warn" and "pip install" in mooncake_check["fix"]
    assert_identical(got, ref, "VPP overlap, Mooncake absent -> torch fallback")


def own_communicator_task(env: dict | None, subclass: bool, config: dict) -> dict:
    """``train_task``'s run with the job passing its own ``p2p_communicator`` (and the process
    groups the schedules then require), as 0.19's ``pretrain(p2p_communicator=...)`` threads it
    through ``train_step``: upstream's class itself, or (``subclass``) a class of the job's."""
    import functools

    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.process_groups_config import ProcessGroupCollection
    from titan_pp_rdma import effects, job_communicator, plugin, session
    from titan_pp_rdma.report import report

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    effects.reset()
    job_communicator.reset()
    session.reset()  # the report's "last session" is this run's
    tiny_gpt.init_parallel(pp=2)
    real = pipeline_parallel.get_forward_backward_func
    upstream = p2p_communication.P2PCommunicator
    cls = type("JobsCommunicator", (upstream,), {}) if subclass else upstream
    built: list = []

    def with_communicator(*args: Any, **kwargs: Any) -> Any:
        comm = cls(pp_group=ps.get_pipeline_model_parallel_group(), config=built[0])
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        return functools.partial(real(*args, **kwargs), p2p_communicator=comm, pg_collection=pgs)

    active = plugin_active("pp_rdma", env=env) if env is not None else contextlib.nullcontext()
    pipeline_parallel.get_forward_backward_func = with_communicator
    try:
        with active:
            cfg = tiny_gpt.make_config(**config)
            built.append(cfg)
            chunks = tiny_gpt.build_model(cfg)
            losses, norms = tiny_gpt.train(chunks, cfg, steps=STEPS, num_microbatches=MICROBATCHES)
            state = report() if env is not None else {}
            plugin_effects = plugin.titan_effects() if env is not None else {}
    finally:
        pipeline_parallel.get_forward_backward_func = real
        job_communicator.reset()  # these workers run other tasks next
    grads = {k: v for k, v in tiny_gpt.state_snapshot(chunks).items() if k.endswith(".grad")}
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "report": state,
        "effects": plugin_effects,
    }


def test_a_communicator_the_job_passes_is_served_or_reported(gloo_pool2: Any) -> None:
    ref = _run(gloo_pool2, 2, None, None, REFERENCE)
    # Upstream's own class, handed to the schedules by the job: pp_rdma carries its transfers
    # as it does for the one the schedules build (before: it never saw them, effects empty).
    got = gloo_pool2.run(own_communicator_task, TORCH_ENV, False, BATCHED, timeout=240)
    moved = STEPS * MICROBATCHES
    for rank in got:
        assert rank["effects"] == {"torch_messages": moved, "torch_bytes": moved * 8192}
        assert rank["report"]["active"] is True and rank["report"]["backend"] == "torch"
    assert_identical(got, ref, "PP=2 1F1B, the job's upstream P2PCommunicator")
    # A class of the job's own: left alone, and pp_rdma says so instead of a silent no-op
    # (upstream's transfers then: the settings upstream gets right).
    own = gloo_pool2.run(own_communicator_task, TORCH_ENV, True, REFERENCE, timeout=240)
    for rank in own:
        assert rank["effects"] == {"stepped_aside": "own p2p_communicator"}
        why = rank["report"]["inactive_reason"]
        assert "JobsCommunicator" in why and "titan_p2p_communicator" in why
        assert rank["report"]["active"] is False
    assert_identical(own, ref, "PP=2 1F1B, the job's own communicator class")
