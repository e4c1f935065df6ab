"""The offloader on plain torch modules (CPU): bit-identical gradients, exact byte accounting,
dedupe, parameter/foreign-hook exclusion, released storages and the host budget."""

from __future__ import annotations

import logging

import pytest
import torch
from titan_act_offload.offloader import Offloader
from titan_act_offload.plan import Unit
from titan_act_offload.settings import OffloadSettings

from titan_plugins import platform

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

HIDDEN, FFN, TOKENS = 64, 256, 8


class Block(torch.nn.Module):
    """Linear -> gelu -> Linear, run as one offload block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _model() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block() for _ in range(3))


def _input() -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def run(model, offloader: Offloader | None, offload: bool, microbatches: int = 3, steps: int = 1):
    """All forwards, then all backwards (the longest wait), like a deep pipeline's warmup."""
    x = _input().requires_grad_()
    for _ in range(steps):
        states, losses = [], []
        for mb in range(microbatches):
            if offloader is not None:
                states.append(offloader.begin_unit(Unit(0, mb), offload, frozenset()))
            h = x * (mb + 1)
            for block in model:
                entered = offloader.enter_block("mlp") if offloader is not None else None
                try:
                    h = block(h)
                finally:
                    if entered is not None:
                        offloader.exit_block(entered)
            if offloader is not None:
                offloader.end_unit_forward(states[-1])
            losses.append(h.square().sum())
        for mb, loss in enumerate(losses):
            if offloader is not None and offload:
                offloader.prefetch_unit(states[mb])
            loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def make_offloader(model, **overrides) -> Offloader:
    settings = OffloadSettings(**{"min_bytes": 0, **overrides})
    offloader = Offloader(settings, platform)
    offloader.param_storages = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
    return offloader


# Saved per block: fc1 input [8,64], gelu input [8,256], fc2 input [8,256] (fp32); weights are
# parameters and stay with autograd.
BLOCK_BYTES = 4 * TOKENS * (HIDDEN + 2 * FFN)
UNIT_BYTES = 3 * BLOCK_BYTES


def test_offload_engine_bit_identical_and_exact_accounting():
    reference = run(_model(), None, False)
    model = _model()
    kept = make_offloader(model)
    assert all(torch.equal(a, b) for a, b in zip(reference, run(model, kept, False)))
    # Nothing offloaded: the peak is all three microbatches' saved bytes, exactly.
    assert kept.stats.peak_resident == kept.stats.peak_kept == 3 * UNIT_BYTES
    # Each Linear saves weight.t(): a view of a parameter, left to autograd.
    assert kept.stats.skipped["parameter_view"] == 3 * 3 * 2
    model = _model()
    off = make_offloader(model)
    twice = run(_model(), None, False, steps=2)  # grads accumulate over the two steps
    assert all(torch.equal(a, b) for a, b in zip(twice, run(model, off, True, steps=2)))
    stats = off.stats
    assert stats.offloaded_bytes == stats.prefetched_bytes == 2 * 3 * UNIT_BYTES
    assert stats.late_reloads == 0 and stats.prefetch_hits == 2 * 3 * 3
    # One block staged in forward; in backward the block in use plus the one prefetched.
    assert stats.max_block_bytes == BLOCK_BYTES
    assert stats.peak_resident == 2 * BLOCK_BYTES and stats.resident == 0
    # Host buffers come back to the pool and are reused by the second step.
    pool = off.pool.stats()
    assert pool["in_use"] == 0 and pool["reuses"] >= pool["allocations"]


def test_offload_engine_dedupes_and_leaves_foreign_hooks_alone():
    off = make_offloader(torch.nn.Linear(1, 1))
    x = torch.randn(16, 16, requires_grad=True)
    state = off.begin_unit(Unit(0, 0), True, frozenset())
    block = off.enter_block("mlp")
    y = x * 2
    z = y * y  # mul saves y twice: one record
    off.exit_block(block)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert off.enter_block("mlp") is None  # another hook owns these saves
    off.end_unit_forward(state)
    assert off.stats.saved_bytes == y.numel() * 4 and off.stats.offloaded_bytes == y.numel() * 4
    assert off.stats.skipped["other_saved_tensors_hooks"] == 1
    z.sum().backward()
    assert torch.equal(x.grad, 8 * x.detach())
    assert off.stats.late_reloads == 1  # nobody prefetched this unit


def test_offload_engine_moves_the_base_of_saved_views_once():
    # Attention's q, k and v are strided slices of the fused QKV output: without offload the
    # saved views pin the whole QKV storage. One record moves that storage; unpack rebuilds
    # each view on the reloaded base.
    lin = torch.nn.Linear(16, 48)

    def forward(x):
        y = lin(x)  # [8, 48]
        q, k, v = y[:, :16], y[:, 16:32], y[:, 32:].t()  # non-dense views of y
        return (q * k).sum() + (v * v).sum()

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    forward(x).backward()
    expected = [x.grad.clone(), lin.weight.grad.clone()]
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    off = make_offloader(lin)
    state = off.begin_unit(Unit(0, 0), True, frozenset())
    block = off.enter_block("attention")
    loss = forward(x)
    off.exit_block(block)
    off.end_unit_forward(state)
    assert off.stats.skipped.get("not_dense", 0) == 0
    assert off.stats.offloaded_bytes == 8 * 48 * 4  # y, once (the input x is a leaf)
    off.prefetch_unit(state)
    loss.backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(lin.weight.grad, expected[1])
    assert off.stats.resident == 0 and off.stats.live == 0 and off.pool.in_use == 0


class _SavesItsOwn(torch.autograd.Function):
    """Saves a tensor made inside forward (no grad_fn), marked as an activation or not."""

    @staticmethod
    def forward(ctx, x, mark):
        from titan_plugins.saved_tensors import mark_activation

        made = x * 3  # grad mode is off in here: no grad_fn
        ctx.save_for_backward(mark_activation(made) if mark else made)
        return x * made

    @staticmethod
    def backward(ctx, grad):
        (made,) = ctx.saved_tensors
        return grad * 2 * made, None


@pytest.mark.parametrize("mark", [True, False])
def test_offload_engine_follows_the_saved_activation_contract(mark):
    x = torch.randn(64, 64, requires_grad=True)
    off = make_offloader(torch.nn.Linear(1, 1))
    state = off.begin_unit(Unit(0, 0), True, frozenset())
    block = off.enter_block("mlp")
    y = _SavesItsOwn.apply(x * 1.0, mark)
    off.exit_block(block)
    off.end_unit_forward(state)
    nbytes = 64 * 64 * 4
    if mark:  # the marked tensor is an activation: it goes to host and comes back intact
        assert off.stats.offloaded_bytes == nbytes and "leaf" not in off.stats.skipped
    else:  # unmarked and without a grad_fn it looks like a constant: left alone
        assert off.stats.offloaded_bytes == 0 and off.stats.skipped_bytes["leaf"] == nbytes
    y.sum().backward()
    assert torch.equal(x.grad, 6 * x.detach())


def test_offload_engine_relative_size_rule_keeps_the_smallest_tail():
    # Default settings: no fixed MIN_BYTES; per block, the smallest saved tensors stay on the
    # device while they add up to at most KEEP_FRACTION (2%) of the block's saved bytes.
    x = torch.randn(4, 1024, requires_grad=True)
    off = Offloader(OffloadSettings(), platform)
    assert off.settings.min_bytes is None and off.settings.keep_fraction == 0.02
    state = off.begin_unit(Unit(0, 0), True, frozenset())
    block = off.enter_block("mlp")
    big = (x * 2).sin()  # saves x * 2: 16 KiB
    tiny = [(x[:, :8] * k).exp() for k in range(3)]  # saves 3 outputs of 128 B (exp saves y)
    off.exit_block(block)
    off.end_unit_forward(state)
    total = 16384 + 3 * 128
    assert off.stats.skipped["small"] == 2  # 2 x 128 B <= 2% of the block; a third is not
    assert off.stats.skipped_bytes["small"] == 256 <= 0.02 * total < 384
    assert off.stats.offloaded_bytes == total - 256 and off.stats.peak_kept == 256
    (big.sum() + sum(t.sum() for t in tiny)).backward()
    assert off.stats.resident == 0 and off.stats.live == 0


def test_offload_engine_accounts_the_whole_stage():
    # What the forward saves outside the selected blocks (a norm, the loss) is watched too: it
    # stays on the device and counts in the stage's figures, with and without offload.
    model = _model()
    off = make_offloader(model)
    x = _input().requires_grad_()
    losses = []
    for mb in range(2):
        state = off.begin_unit(Unit(0, mb), True, frozenset())
        h = torch.sigmoid(x * (mb + 1))  # outside: sigmoid saves its output (8 x 64 fp32)
        block = off.enter_block("mlp")
        h = model[0](h)
        off.exit_block(block)
        losses.append(h.square().sum())  # outside: pow saves its input (8 x 64 fp32)
        off.end_unit_forward(state)
    stats = off.stats
    outside = 2 * TOKENS * HIDDEN * 4  # per unit
    # fc1's input is the sigmoid's saved output: one record, kept (the sigmoid needs it).
    block = 2 * TOKENS * FFN * 4
    assert stats.outside == 2 * outside and stats.resident == 0  # blocks went to host
    assert stats.peak_stage_live == 2 * (outside + block)  # nothing moved: all of it
    # Peak while unit 1's block is staged: unit 0's outside saves, unit 1's sigmoid, the block.
    assert stats.peak_stage == outside + outside // 2 + block
    for loss in losses:
        loss.backward()
    assert stats.stage == stats.outside == stats.stage_live == 0


def test_offload_engine_leaves_released_storage_to_its_owner():
    # What megatron's CheckpointWithoutOutput does: the saved output's storage is resized to 0
    # after the consumer saved it, and restored (recomputed) before backward reads it.
    lin = torch.nn.Linear(32, 32)
    off = make_offloader(lin)
    x = torch.randn(4, 32, requires_grad=True)
    state = off.begin_unit(Unit(0, 0), True, frozenset())
    block = off.enter_block("layer")
    a = torch.sigmoid(x) * 3
    out = lin(a)  # saves a
    a.untyped_storage().resize_(0)
    off.exit_block(block)
    off.end_unit_forward(state)
    assert off.stats.skipped["released_storage"] == 1 and off.stats.resident >= 0
    with torch.no_grad():  # the owner's recompute
        a.untyped_storage().resize_(4 * 32 * 4)
        a.copy_(torch.sigmoid(x) * 3)
    out.sum().backward()
    expected = torch.autograd.grad((lin(torch.sigmoid(x) * 3)).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_offload_engine_host_budget_keeps_on_device_with_warning(caplog):
    reference = run(_model(), None, False)
    model = _model()
    off = make_offloader(model, max_host_bytes=2 * BLOCK_BYTES)
    with caplog.at_level(logging.WARNING, logger="titan_plugins.act_offload"):
        grads = run(model, off, True)
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    assert "host buffer budget reached" in caplog.text
    assert off.stats.kept_over_budget_bytes > 0 and off.pool.capacity <= 2 * BLOCK_BYTES
    assert off.stats.offloaded_bytes + off.stats.kept_over_budget_bytes == 3 * UNIT_BYTES


def test_offload_settings_read_env(monkeypatch):
    monkeypatch.setenv("TITAN_ACT_OFFLOAD_MODULES", "attention,experts")
    monkeypatch.setenv("TITAN_ACT_OFFLOAD_MAX_HOST_BYTES", "512M")
    monkeypatch.setenv("TITAN_ACT_OFFLOAD_MIN_GAP", "0")
    settings = OffloadSettings.from_env()
    assert settings.modules == ("attention", "experts")
    assert settings.max_host_bytes == 512 << 20 and settings.min_gap == 0
    assert settings.min_bytes is None and settings.keep_fraction == 0.02  # the relative rule
    monkeypatch.setenv("TITAN_ACT_OFFLOAD_MAX_HOST_BYTES", "4G")
    assert OffloadSettings.from_env().max_host_bytes == 4 << 30
    monkeypatch.delenv("TITAN_ACT_OFFLOAD_MAX_HOST_BYTES")
    assert OffloadSettings.from_env().max_host_bytes > 0  # auto: a share of physical memory


@pytest.mark.parametrize(
    "var, value",
    [
        ("TITAN_ACT_OFFLOAD_MODULES", "attention,bogus"),
        ("TITAN_ACT_OFFLOAD_MAX_HOST_BYTES", "0.5"),
        ("TITAN_ACT_OFFLOAD_MAX_HOST_BYTES", "0"),
        ("TITAN_ACT_OFFLOAD_KEEP_FRACTION", "nan"),
        ("TITAN_ACT_OFFLOAD_MIN_GAP", "-1"),
    ],
)
def test_offload_settings_bad_values_warn_or_raise_under_strict(monkeypatch, caplog, var, value):
    from titan_act_offload.settings import SETTINGS

    from titan_plugins.settings import SettingError, problems

    monkeypatch.setenv(var, value)
    (message,) = problems(SETTINGS)  # what the core reports at activation
    assert var in message and repr(value) in message
    with caplog.at_level(logging.WARNING):
        assert OffloadSettings.from_env() == OffloadSettings.from_env()  # defaults, no raise
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=var):
        OffloadSettings.from_env()


@pytest.mark.parametrize("name", ["attention", "layer"])
def test_offload_block_patches_declared(name):
    from titan_act_offload import block_patches, plugin, runtime

    rt = runtime.Runtime(OffloadSettings(modules=(name,)))
    records = block_patches.patches(rt)
    assert all(r.rationale and r.remove_when for r in records)
    assert records and all(f"block.{name}." in r.id for r in records)
    # The schedule is followed through the core's training-loop hooks, not patches of its own.
    assert not any("schedules" in r.target for r in records)
    for hook in ("titan_train_step", "titan_forward_microbatch", "titan_backward_microbatch"):
        assert getattr(plugin, hook).titan_impl["wrapper"]


def _drive(model, offloader, plan, backward_order):
    """Run the plan's forwards in order, then backwards in ``backward_order`` via a Step."""
    from titan_act_offload.step import Step

    step = Step(offloader, plan, [model])
    x = _input().requires_grad_()
    losses = {}
    for event in plan.events:
        if event.kind != "F":
            continue
        state = step.begin_forward(model, None, None)
        h = x * (event.unit.microbatch + 1)
        for block in model:
            entered = offloader.enter_block("mlp")
            try:
                h = block(h)
            finally:
                offloader.exit_block(entered)
        losses[event.unit.microbatch] = h.square().sum()
        step.end_forward(state, losses[event.unit.microbatch])
    for mb in backward_order:
        unit = step.begin_backward(losses[mb])
        losses[mb].backward()
        step.end_backward(unit)
    step.finish()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], step


def test_offload_step_follows_plan_and_survives_a_mismatch(caplog):
    from titan_act_offload.plan import build_plan, schedule_events

    plan = build_plan(schedule_events("1f1b", 4, 0, 2), min_gap=0)
    assert [e.kind for e in plan.events] == ["F", "F", "B", "B"]
    reference = run(_model(), None, False, microbatches=2)
    model = _model()
    off = make_offloader(model)
    grads, step = _drive(model, off, plan, [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    assert step.mismatches == 0 and off.stats.late_reloads == 0
    assert off.stats.unit_bytes == {(0, 0): UNIT_BYTES, (0, 1): UNIT_BYTES}
    # Backward in another order than planned: warn, stop prefetching, reload on demand.
    model = _model()
    off = make_offloader(model)
    with caplog.at_level(logging.WARNING, logger="titan_plugins.act_offload"):
        grads, step = _drive(model, off, plan, [1, 0])
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    assert step.mismatches == 1 and "the plan expected" in caplog.text
    assert off.stats.late_reloads > 0 and off.stats.resident == 0


def test_offload_registration_is_import_light():
    # What runs while megatron imports (the entry point, its settings, the block patch records)
    # imports neither torch nor megatron nor the offload machinery: they load at the first
    # training schedule.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import titan_act_offload.plugin as p\n"
        "from titan_act_offload import block_patches, runtime\n"
        "from titan_act_offload.settings import OffloadSettings\n"
        "p.titan_settings()\n"
        "assert block_patches.patches(runtime.Runtime(OffloadSettings.from_env()))\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "heavy += [m for m in sys.modules if m.startswith('titan_act_offload.') and\n"
        "          m.split('.')[1] not in ('plugin', 'runtime', 'settings', 'block_patches', 'version')]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class _CountingMode(torch.overrides.TorchFunctionMode):
    """A pass-through mode of the user's (like the CPU harness's CUDA-to-CPU shim)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_of_the_user_sees_the_model_not_the_offloader():
    """The hooks' metadata reads and copies are not model ops: a mode active around training
    sees exactly the calls it sees without the offloader (each one it saw cost a Python
    dispatch: ~4,400 per step in the CPU benchmark, ~2% of its step time)."""
    model = _model()
    with _CountingMode() as plain:
        reference = run(model, None, False)
    model = _model()
    off = make_offloader(model)
    with _CountingMode() as offloaded:
        got = run(model, off, True)
    assert off.stats.offloaded_bytes == 3 * UNIT_BYTES  # every block went to host and back
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    assert offloaded.calls == plain.calls > 0
