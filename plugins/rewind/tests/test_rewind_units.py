"""Unit tests of rewind's parts on plain torch: detectors, the all-reduce vector, the snapshot
schedule, and a restore that must be bit-exact (fp32 masters, Adam state, buffers, scaler, RNG).

The optimizer stand-ins have the attributes the plugin reads from megatron's optimizers
(``optimizer`` = the torch optimizer, ``grad_scaler``, ``chained_optimizers``); the real ones
are exercised through megatron's schedules in ``test_rewind_megatron.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from titan_rewind import collective, inject
from titan_rewind.detect import Detector, GradNormSpike, LossSpike, Signals
from titan_rewind.snapshot import RestoreError, Snapshotter
from titan_rewind.snapshot import Slot as SnapshotSlot
from titan_rewind.store import SnapshotStore

from titan_plugins.errors import JobStopped


# ------------------------------------------------------------------------------ detectors
def test_loss_spike_is_silent_in_warm_up_then_uses_median_and_mad():
    spike = LossSpike(window=5, min_history=3, zscore=4.0, min_spread=0.0)
    for value in (2.0, 2.2):
        assert spike.check(100.0) is None  # warm-up
        spike.accept(value)
    spike.accept(1.8)
    # median 2.0, MAD 0.2 -> bar 2.0 + 4 * 1.4826 * 0.2
    bar = 2.0 + 4 * 1.4826 * 0.2
    assert spike.threshold() == pytest.approx(bar)
    assert spike.check(bar - 1e-9) is None
    found = spike.check(bar + 1e-6)
    assert found.kind == "loss_spike" and found.threshold == pytest.approx(bar)
    assert spike.check(0.1) is None  # one-sided: a falling loss never triggers


def test_loss_spike_spread_floor_keeps_a_flat_curve_quiet():
    spike = LossSpike(window=10, min_history=3, zscore=6.0, min_spread=0.05)
    for _ in range(10):
        spike.accept(2.0)  # MAD 0
    assert spike.threshold() == pytest.approx(2.0 + 6 * 0.1)
    assert spike.check(2.5) is None and spike.check(2.7) is not None


def test_loss_window_forgets_old_values():
    spike = LossSpike(window=3, min_history=3, zscore=1.0, min_spread=0.0)
    for value in (10.0, 10.0, 10.0, 1.0, 1.0, 1.0):
        spike.accept(value)
    assert spike.threshold() == pytest.approx(1.0)


def test_grad_norm_spike_factor_over_the_rolling_median():
    grad = GradNormSpike(window=3, min_history=2, factor=5.0, zscore=0.0)
    grad.accept(1.0)
    assert grad.check(100.0) is None  # warm-up
    grad.accept(3.0)  # median of 1 and 3 on logarithms: sqrt(3)
    assert grad.threshold() == pytest.approx(5.0 * math.sqrt(3.0))
    for value in (2.0, 2.0):  # the window (3) forgets the 1.0 and the 3.0
        grad.accept(value)
    assert grad.threshold() == pytest.approx(10.0)
    assert grad.check(9.9) is None and grad.check(10.1).kind == "grad_norm_spike"


def test_detector_order_and_switches():
    detector = Detector(
        ("nonfinite", "loss", "grad_norm"), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(5, 1, 2.0, 0.0)
    )
    detector.accept(Signals(loss=1.0, grad_norm=1.0))
    assert detector.check(Signals(loss=1.0, grad_norm=1.0)) is None
    assert detector.check(Signals(1.0, None, nonfinite_loss=True)).kind == "nonfinite_loss"
    assert detector.check(Signals(1.0, None, nonfinite_grad=True)).kind == "nonfinite_grad"
    assert detector.check(Signals(loss=5.0, grad_norm=5.0)).kind == "loss_spike"
    assert detector.check(Signals(loss=1.0, grad_norm=5.0)).kind == "grad_norm_spike"
    only_nan = Detector(("nonfinite",), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(5, 1, 2.0, 0.0))
    only_nan.accept(Signals(loss=1.0, grad_norm=1.0))
    assert only_nan.check(Signals(loss=50.0, grad_norm=50.0)) is None
    no_nan = Detector(("loss",), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(5, 1, 2.0, 0.0))
    assert no_nan.check(Signals(math.nan, None, nonfinite_loss=True)) is None


# ------------------------------------------------------------------------------ the vector
def test_local_loss_reads_megatron_reports():
    reports = [{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([2.0, 1.0])}]
    assert collective.local_loss(reports, "") == (8.0, 4.0)
    legacy = [torch.tensor(2.0), torch.tensor(4.0)]
    assert collective.local_loss(legacy, "") == (6.0, 2.0)
    other = [{"pg_loss": torch.tensor(1.5), "entropy": torch.tensor(9.0)}]
    assert collective.local_loss(other, "") == (1.5, 1.0)  # first key when no 'lm loss'
    assert collective.local_loss(other, "entropy") == (9.0, 1.0)
    with pytest.raises(KeyError, match="TITAN_REWIND_LOSS_KEY='nope'.*pg_loss, entropy"):
        collective.local_loss(other, "nope")
    assert collective.local_loss([], "") == (0.0, 0.0)


def test_vector_flags_and_single_process_reduction():
    assert collective.reduce_signals(collective.local_vector((8.0, 4.0), 3.0, True)) == Signals(
        loss=2.0, grad_norm=3.0
    )
    bad = collective.reduce_signals(collective.local_vector((math.nan, 4.0), math.inf, True))
    assert bad.nonfinite_loss and bad.nonfinite_grad and bad.loss is None
    # clip_grad == 0: megatron reports 0.0 (not computed); a rank without params: None
    assert collective.reduce_signals(collective.local_vector(None, 0.0, True)).grad_norm is None
    assert collective.reduce_signals(collective.local_vector(None, None, False)).skipped
    # A rank that holds nothing to roll back to is counted, so every rank knows.
    lacking = collective.local_vector((8.0, 4.0), 3.0, True, can_roll_back=False)
    assert collective.reduce_signals(lacking).cannot_roll_back == 1


# ------------------------------------------------------------------------------ snapshots
class Scaler:
    """A grad scaler with megatron's state_dict shape (a tensor and two counters)."""

    def __init__(self) -> None:
        self.scale = torch.tensor([1024.0])
        self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = state["scale"], state["growth_tracker"]


class MixedPrecision:
    """bf16 model params with fp32 masters stepped by torch Adam (megatron's Float16 optimizer
    layout: ``optimizer`` steps the masters, the step copies them back to the model)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = params
        self.masters = [p.detach().float().clone().requires_grad_() for p in params]
        self.optimizer = torch.optim.Adam(self.masters, lr=1e-2)
        self.grad_scaler = Scaler()

    def step(self) -> None:
        for model, master in zip(self.model_params, self.masters):
            master.grad = model.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for model, master in zip(self.model_params, self.masters):
                model.copy_(master)
        self.grad_scaler.growth_tracker += 1
        self.grad_scaler.scale = self.grad_scaler.scale * 2


class Chained:
    def __init__(self, children: list) -> None:
        self.chained_optimizers = children


def make_model() -> tuple[torch.nn.Module, Chained]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).bfloat16()
    params = list(model.parameters())
    return model, Chained([MixedPrecision(params[:2]), MixedPrecision(params[2:])])


def train_one(model: torch.nn.Module, optimizer: Chained, seed: int) -> None:
    model.zero_grad()
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, 8, generator=generator).bfloat16()
    noise = torch.rand(8)  # consumes the global RNG, like dropout
    model(inputs).float().mul(noise).square().sum().backward()
    for child in optimizer.chained_optimizers:
        child.step()


def full_state(model: torch.nn.Module, optimizer: Chained) -> dict:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for n, child in enumerate(optimizer.chained_optimizers):
        for i, master in enumerate(child.masters):
            out[f"opt{n}.master{i}"] = master.detach().clone()
            for key, value in child.optimizer.state[master].items():
                out[f"opt{n}.state{i}.{key}"] = value.clone()
        out[f"opt{n}.scale"] = child.grad_scaler.scale.clone()
        out[f"opt{n}.growth"] = torch.tensor(child.grad_scaler.growth_tracker)
    out["rng"] = torch.get_rng_state()
    return out


def assert_bit_identical(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert left[key].dtype == right[key].dtype, key
        assert torch.equal(left[key], right[key]), key


def test_restore_is_bit_exact_for_masters_moments_buffers_scaler_and_rng():
    model, optimizer = make_model()
    for seed in range(3):
        train_one(model, optimizer, seed)
    slot = SnapshotSlot()
    saved = full_state(model, optimizer)
    Snapshotter().capture(slot, 2, [model], optimizer)
    versions = [p._version for p in model.parameters()]
    for seed in range(3, 6):
        train_one(model, optimizer, seed)
    with torch.no_grad():  # what a NaN step leaves behind
        for child in optimizer.chained_optimizers:
            for master in child.masters:
                master.fill_(math.nan)
    Snapshotter().restore(slot, [model], optimizer)
    assert_bit_identical(full_state(model, optimizer), saved)
    # The masters keep their fp32 low bits (never rebuilt from the bf16 model weights).
    master = optimizer.chained_optimizers[0].masters[0]
    assert not torch.equal(master, master.bfloat16().float())
    # Each model param was written through itself: caches keyed on _version see the restore.
    assert all(p._version > v for p, v in zip(model.parameters(), versions))
    # Restoring continues exactly like the run that never left (same RNG, same state).
    train_one(model, optimizer, 99)
    reference_model, reference_opt = make_model()
    for seed in (0, 1, 2, 99):
        train_one(reference_model, reference_opt, seed)
    assert_bit_identical(full_state(model, optimizer), full_state(reference_model, reference_opt))


def test_restore_drops_state_created_after_the_snapshot():
    model = torch.nn.Linear(4, 4)
    optimizer = type("FP32", (), {})()
    optimizer.optimizer = torch.optim.Adam(model.parameters())  # no state until the first step
    slot = SnapshotSlot()
    Snapshotter().capture(slot, 0, [model], optimizer)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.optimizer.step()
    assert optimizer.optimizer.state
    Snapshotter().restore(slot, [model], optimizer)
    assert not optimizer.optimizer.state


def test_restore_refuses_a_changed_model():
    model, optimizer = make_model()
    train_one(model, optimizer, 0)
    slot = SnapshotSlot()
    Snapshotter().capture(slot, 0, [model], optimizer)
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)).bfloat16()
    with pytest.raises(RestoreError, match="changed since the snapshot of step 0"):
        Snapshotter().restore(slot, [other], optimizer)


def test_store_keeps_a_stable_and_a_pending_snapshot():
    model, optimizer = make_model()
    store = SnapshotStore(interval=2, stable_after=3, budget=1 << 30)
    taken = []
    for step in range(9):
        train_one(model, optimizer, step)
        if store.on_healthy_step(step, [model], optimizer):
            taken.append(step)
        assert len(store.held()) <= 2
    # 0 first; then due every 2 steps, but the pending one must be stable (3 healthy steps
    # after it) before the next is taken: stable at 3 -> next at 3, stable at 6 -> next at 6.
    assert taken == [0, 3, 6]
    assert store.rollback_target().step == 3 and store.pending.step == 6
    assert store.host_bytes() == 2 * store.planned
    slot = store.restore([model], optimizer)
    assert slot.step == 3 and store.pending.empty and store.rollback_target().step == 3


def test_store_no_snapshot_takes_no_snapshot_and_says_why():
    model, optimizer = make_model()
    train_one(model, optimizer, 0)
    store = SnapshotStore(interval=1, stable_after=1, budget=100)
    assert not store.on_healthy_step(0, [model], optimizer)
    assert store.rollback_target() is None and store.host_bytes() == 0
    assert "over the rewind budget of 100" in store.no_snapshot
    assert "TITAN_REWIND_MAX_HOST_BYTES >= " in store.no_snapshot
    assert store.no_snapshot_knobs == ("TITAN_REWIND_MAX_HOST_BYTES",)


# ------------------------------------------------------------------------------ injection
def test_poison_forward_fires_once_on_the_first_loss():
    inject.clear()
    inject.nan_at_step(3)
    try:
        seen = []

        def forward(data, model):
            return torch.ones(2), lambda out: seen.append(out.clone())

        assert inject.poison_forward(2, forward) is forward
        poisoned = inject.poison_forward(3, forward)
        for _ in range(2):
            _, loss_func = poisoned(None, None)
            loss_func(torch.ones(2))
        assert torch.isnan(seen[0]).all() and torch.equal(seen[1], torch.ones(2))
        assert inject.fired() == {3} and not inject.armed()
        with pytest.raises(ValueError, match="negative"):
            inject.nan_at_step(-1)
    finally:
        inject.clear()


# ------------------------------------------------------------------------------ the starting state
def forward_backward(model: torch.nn.Module, seed: int) -> None:
    """``train_one`` without the update: the forward (BatchNorm's running stats change, the
    global RNG is drawn from, like dropout) and the backward."""
    model.zero_grad()
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)).bfloat16()
    model(inputs).float().mul(torch.rand(8)).square().sum().backward()


def update(optimizer: Chained) -> None:
    for child in optimizer.chained_optimizers:
        child.step()


def test_the_starting_state_is_the_rollback_target_until_a_snapshot_is_stable():
    from titan_rewind.snapshot import capture_early

    model, optimizer = make_model()
    store = SnapshotStore(interval=2, stable_after=3, budget=1 << 30)
    early = capture_early([model])
    forward_backward(model, 0)
    assert store.capture_start([model], optimizer, early)  # before the first update
    assert store.rollback_target().start and store.rollback_target().step == -1
    assert store.describe()["snapshots"][0]["start"]
    start_bytes = store.planned  # no Adam state yet
    reserved = store.ledger.held  # two snapshots with the moments torch will create
    update(optimizer)
    taken = []
    for step in range(9):
        if step:
            train_one(model, optimizer, step)
        if store.on_healthy_step(step, [model], optimizer):
            taken.append(step)
        assert store.rollback_target() is not None and len(store.held()) <= 2
        if step < 3:  # the snapshot of step 0 becomes stable after 3 healthy steps
            assert store.rollback_target().start
    # The regular schedule is unchanged: after step 0, then every 2 once the pending is stable.
    assert taken == [0, 3, 6] and store.taken == 4
    assert store.rollback_target().step == 3
    # Planned at every capture: Adam's moments (created at the first update) are counted.
    assert store.planned > start_bytes and store.host_bytes() == 2 * store.planned
    # The start's estimate of Adam's state was exact: the reservation never had to grow.
    assert store.ledger.held == reserved == 2 * store.planned


def test_restoring_the_starting_state_continues_like_a_run_that_skipped_those_steps():
    """Buffers and RNG from before the first forward, masters as loaded, the torch optimizers
    back to "no state yet", the scaler as loaded: continuing equals a fresh run."""
    from titan_rewind.snapshot import capture_early

    model, optimizer = make_model()
    loaded = full_state(model, optimizer)  # no optimizer state in it yet
    store = SnapshotStore(interval=10, stable_after=5, budget=1 << 30)
    early = capture_early([model])
    forward_backward(model, 0)
    store.capture_start([model], optimizer, early)
    update(optimizer)
    for seed in (1, 2):
        train_one(model, optimizer, seed)
        store.on_healthy_step(seed, [model], optimizer)
    with torch.no_grad():  # what a NaN step leaves behind
        for child in optimizer.chained_optimizers:
            for master in child.masters:
                master.fill_(math.nan)
    slot = store.restore([model], optimizer)
    assert slot.start and store.pending.empty
    assert all(not child.optimizer.state for child in optimizer.chained_optimizers)
    assert_bit_identical(full_state(model, optimizer), loaded)
    assert not store.regular_taken  # the schedule starts over: a snapshot after the next step
    train_one(model, optimizer, 99)
    assert store.on_healthy_step(3, [model], optimizer)
    reference_model, reference_opt = make_model()
    train_one(reference_model, reference_opt, 99)
    assert_bit_identical(full_state(model, optimizer), full_state(reference_model, reference_opt))


def test_a_start_over_the_budget_counts_the_optimizer_state_to_come():
    from titan_rewind.snapshot import plan

    from titan_plugins.settings import describe_bytes

    model, optimizer = make_model()
    now, full, exact = plan([model], optimizer)
    masters = sum(m.numel() * 4 for c in optimizer.chained_optimizers for m in c.masters)
    count = sum(len(c.masters) for c in optimizer.chained_optimizers)
    assert exact and full == now + 2 * masters + 4 * count  # Adam: two moments and a step
    store = SnapshotStore(interval=1, stable_after=1, budget=2 * full - 1)
    assert not store.capture_start([model], optimizer)
    assert store.rollback_target() is None
    assert f"need {describe_bytes(2 * full)} of host memory" in store.no_snapshot
    assert "with the Adam moments the first update creates" in store.no_snapshot
    assert "a fault cannot be rolled back" in store.no_snapshot
    # Another optimizer without state yet: the size is only a lower bound, and says so.
    sgd = type("FP32", (), {})()
    sgd.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert plan([model], sgd)[2] is False
    store = SnapshotStore(interval=1, stable_after=1, budget=1)
    assert not store.capture_start([model], sgd) and "need at least" in store.no_snapshot


def test_the_shared_ledger_refusal_names_the_shared_knob_and_the_other_holders(monkeypatch):
    from titan_plugins import host_memory

    model, optimizer = make_model()
    other = host_memory.Reservation("act_offload")
    monkeypatch.setenv("TITAN_PLUGINS_MAX_HOST_BYTES", "2000")
    try:
        assert other.grow(1000)
        store = SnapshotStore(interval=1, stable_after=1, budget=1 << 30)
        assert not store.capture_start([model], optimizer)
    finally:
        other.close()
    assert store.no_snapshot_knobs == (
        "TITAN_PLUGINS_MAX_HOST_BYTES",
        "TITAN_ACT_OFFLOAD_MAX_HOST_BYTES",
    )
    assert "shared host-memory limit" in store.no_snapshot and "act_offload" in store.no_snapshot


# ------------------------------------------------------------------------------ the state machine
class Loop:
    """Drives a Rewinder through the hooks as the core calls them, on the fake optimizer: a
    training call (``loss`` NaN on a fault), then the optimizer step."""

    def __init__(self, rewinder, data=None, microbatches: int = 2) -> None:
        from types import SimpleNamespace

        self.rewinder = rewinder
        self.model, self.optimizer = make_model()
        self.data = data
        self.microbatches = microbatches
        self.ns = SimpleNamespace

    def step(self, index: int, fault: bool = False, loss: float = 2.0) -> None:
        kwargs = {"data_iterator": self.data, "num_microbatches": self.microbatches}
        train = self.ns(
            index=index, model=[self.model], num_microbatches=self.microbatches, kwargs=kwargs
        )
        opt_step = self.ns(step=train, optimizer=self.optimizer)
        self.rewinder.before_train_step(train)
        for _ in range(self.microbatches if self.data is not None else 0):
            next(self.data, None)
        forward_backward(self.model, index)
        report = torch.tensor([math.nan if fault else loss, 1.0])
        self.rewinder.after_train_step(train, [{"lm loss": report}])
        self.rewinder.before_optimizer_step(opt_step)
        update(self.optimizer)
        self.rewinder.after_optimizer_step(opt_step, (True, 1.0, 0))


def test_an_early_fault_rolls_back_to_the_starting_state(caplog):
    from titan_rewind.config import RewindConfig
    from titan_rewind.runtime import Rewinder

    rewinder = Rewinder(RewindConfig())
    run = Loop(rewinder)
    loaded = full_state(run.model, run.optimizer)
    with caplog.at_level("WARNING", logger="titan_plugins.rewind"):
        run.step(0)
        run.step(1, fault=True)
    (event,) = rewinder.events
    assert (event.step, event.snapshot_step, event.steps_skipped) == (1, -1, 2)
    assert event.microbatches_skipped == 4
    assert "restored the starting state (before step 0)" in caplog.text
    assert_bit_identical(full_state(run.model, run.optimizer), loaded)


def test_nothing_to_roll_back_to_raises_one_message_naming_step_reason_and_knobs(monkeypatch):
    from titan_rewind import RewindError, runtime
    from titan_rewind.config import RewindConfig

    def fault(rank: int) -> RewindError:
        monkeypatch.setattr(runtime, "_rank", lambda: rank)
        run = Loop(runtime.Rewinder(RewindConfig(max_host_bytes=1)))
        run.step(0)
        with pytest.raises(RewindError) as caught:
            run.step(1, fault=True)
        return caught.value

    error = fault(0)
    assert error.primary and isinstance(error, JobStopped) and error.exit_code != 0
    assert (error.step, error.knobs) == (1, ("TITAN_REWIND_MAX_HOST_BYTES",))
    text = str(error)
    # The message leads with the last steps' numbers, then says why the run stops.
    assert text.splitlines()[:3] == [
        "rewind: the last 2 step(s) before the stop (global loss, grad norm):",
        "  step 0: loss 2, grad norm 1",
        "  step 1: loss nan/inf, grad norm 1 (nonfinite_loss)",
    ]
    assert text.splitlines()[3].startswith(
        "rewind: step 1: nonfinite_loss nan, and nothing to roll back to"
    )
    assert "rank(s) 0: two snapshots of this rank need " in text
    assert "(with the Adam moments the first update creates)" in text
    assert "over the rewind budget of 1" in text and "TITAN_REWIND_MAX_HOST_BYTES >=" in text
    assert text.splitlines()[-1] == "knobs that would have helped: TITAN_REWIND_MAX_HOST_BYTES"
    other = fault(1)  # any other rank: one line that points at rank 0
    assert not other.primary and other.step == 1 and "\n" not in str(other)
    assert "rank 0 raised the job's message" in str(other)


def test_an_escalation_that_cannot_skip_says_so_and_the_final_error_does_not_advise_it(caplog):
    from titan_rewind import RewindError
    from titan_rewind.config import RewindConfig
    from titan_rewind.runtime import Rewinder

    rewinder = Rewinder(RewindConfig(escalate_skip=3))
    fresh = iter([])  # what a loop that hands the schedule a new iterator each step leaves
    run = Loop(rewinder, data=fresh)
    run.step(0)
    with caplog.at_level("WARNING", logger="titan_plugins.rewind"):
        run.step(1, fault=True)
        run.step(2, fault=True)
        with pytest.raises(RewindError) as caught:
            run.step(3, fault=True)
    first, second = rewinder.events
    assert (first.level, second.level) == (1, 2)
    assert second.extra_microbatches_dropped == 0 and second.extra_microbatches_wanted == 6
    assert "ended at once" in second.skip_problem
    assert "meant to drop 6 more microbatches per data iterator but could not" in caplog.text
    assert "dropped 0" not in caplog.text
    text = str(caught.value)
    assert "steps 1, 2, 3" in text and "TITAN_REWIND_ESCALATE_SKIP had no effect" in text
    assert text.startswith("rewind: the last 4 step(s) before the stop (global loss, grad norm):")
    assert caught.value.knobs == ("TITAN_REWIND_MAX_REWINDS",)


def test_giving_up_leads_with_the_last_steps_losses_and_grad_norms():
    from titan_rewind import RewindError, runtime
    from titan_rewind.config import RewindConfig

    run = Loop(runtime.Rewinder(RewindConfig()))
    for index in range(10):
        run.step(index, loss=3.0 - 0.125 * index)  # falling: 3.0 ... 1.875, all healthy
    run.step(10, fault=True)
    run.step(11, fault=True)
    with pytest.raises(RewindError) as caught:
        run.step(12, fault=True)
    lines = str(caught.value).splitlines()
    assert lines[:9] == [
        "rewind: the last 8 step(s) before the stop (global loss, grad norm):",
        "  step 5: loss 2.375, grad norm 1",
        "  step 6: loss 2.25, grad norm 1",
        "  step 7: loss 2.125, grad norm 1",
        "  step 8: loss 2, grad norm 1",
        "  step 9: loss 1.875, grad norm 1",
        "  step 10: loss nan/inf, grad norm 1 (nonfinite_loss)",
        "  step 11: loss nan/inf, grad norm 1 (nonfinite_loss)",
        "  step 12: loss nan/inf, grad norm 1 (nonfinite_loss)",
    ]
    assert lines[9].startswith("rewind: nonfinite_loss nan at step 12 is fault number 3")


# ------------------------------------------------------------------------------ skipping batches
def _train(data, microbatches: int = 2):
    from titan_plugins.hosts.megatron import train_step

    kwargs = {"data_iterator": data, "num_microbatches": microbatches}
    return train_step.TrainStep(print, (), kwargs, schedule="1f1b")


def test_drop_batches_advances_plain_and_per_chunk_iterators():
    from titan_rewind.loop import drop_batches

    plain = iter(range(100))
    skip = drop_batches(_train(plain), 3)
    assert (skip.wanted, skip.dropped, skip.iterators, skip.problem) == (6, 6, 1, "")
    assert next(plain) == 6
    # VPP: one iterator per chunk, None on a chunk without data, the same object listed twice
    # advanced once.
    first, second = iter(range(100)), iter(range(100))
    skip = drop_batches(_train([first, None, first, second]), 2)
    assert (skip.dropped, skip.iterators) == (4, 2)
    assert (next(first), next(second)) == (4, 4)
    assert drop_batches(_train(None), 2).iterators == 0  # a stage that reads no data


def test_drop_batches_reports_what_it_could_not_drop():
    from titan_rewind.loop import drop_batches

    ended = iter([1, 2])
    list(ended)  # the schedule read its step's microbatches: a new iterator comes next step
    skip = drop_batches(_train(ended), 2)
    assert skip.dropped == 0 and "ended at once" in skip.problem
    short = drop_batches(_train(iter(range(3))), 2)
    assert short.dropped == 3 and "ended after 3" in short.problem
    assert "not a Python iterator" in drop_batches(_train(object()), 1).problem


def test_drop_batches_reads_megatron_lms_rerun_iterator_underneath():
    from megatron.core.rerun_state_machine import RerunDataIterator
    from titan_rewind.loop import drop_batches

    inner = iter(range(100))
    rerun = RerunDataIterator(inner)
    rerun.saved_microbatches = ["a", "b"]  # the last iteration's batches, kept for a replay
    rerun.replaying = True  # left on after a re-run of that iteration
    skip = drop_batches(_train([rerun]), 2)
    assert (skip.dropped, skip.problem) == (4, "")
    assert next(inner) == 4 and rerun.saved_microbatches == ["a", "b"]


def test_drop_batches_leaves_slimes_rollout_iterator_alone_and_says_why():
    from titan_rewind.loop import drop_batches

    class DataIterator:  # slime.backends.megatron_utils.data.DataIterator's interface
        def __init__(self) -> None:
            self.micro_batch_indices = [[0], [1], [2], [3]]
            self.offset = 2

        def get_next(self, keys):
            self.offset += 1
            return {}

    chunks = [DataIterator(), DataIterator()]
    skip = drop_batches(_train(chunks), 1)
    assert skip.dropped == 0 and "slime's DataIterator" in skip.problem
    assert [c.offset for c in chunks] == [2, 2]


def test_an_unsupported_optimizer_setup_names_megatrons_setting_and_no_rewind_knob():
    from types import SimpleNamespace

    from titan_rewind import RewindError
    from titan_rewind.config import RewindConfig
    from titan_rewind.runtime import Rewinder

    run = Loop(Rewinder(RewindConfig()))
    run.optimizer.config = SimpleNamespace(overlap_param_gather_with_optimizer_step=True)
    run.step(0)
    with pytest.raises(RewindError) as caught:
        run.step(1, fault=True)
    text = str(caught.value)
    assert "rank(s) 0: overlap_param_gather_with_optimizer_step is on" in text
    assert "rewind: overlap" not in text  # the per-rank reason, without the log prefix
    assert text.endswith("no rewind knob would have helped (see the reason above)")
    assert caught.value.knobs == ()


@pytest.mark.parametrize("value", ["²", "1" * 5000, "-1", "3,x"])
def test_an_injected_step_that_is_no_step_index_is_the_knobs_problem(monkeypatch, value):
    """``str.isdigit`` accepts '²' and 5000-digit strings, which int() then refused at
    activation: the knob names its own problem and the default (no injection) applies."""
    from titan_rewind import settings

    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "0")
    monkeypatch.setenv("TITAN_REWIND_INJECT_NAN_STEP", value)
    assert settings.INJECT_NAN_STEP.problem() is not None
    assert settings.INJECT_NAN_STEP.read() == settings.INJECT_NAN_STEP.default
