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


def test_grad_norm_spike_factor_over_ema():
    grad = GradNormSpike(factor=5.0, beta=0.5, min_history=2)
    grad.accept(1.0)
    assert grad.check(100.0) is None  # warm-up
    grad.accept(3.0)  # ema = 0.5 * 1 + 0.5 * 3
    assert grad.threshold() == pytest.approx(10.0)
    assert grad.check(9.9) is None and grad.check(10.1).kind == "grad_norm_spike"


def test_detector_order_and_switches():
    detector = Detector(
        ("nonfinite", "loss", "grad_norm"), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(2.0, 0.5, 1)
    )
    detector.accept(Signals(loss=1.0, grad_norm=1.0))
    assert detector.check(Signals(loss=1.0, grad_norm=1.0)) is None
    assert detector.check(Signals(1.0, None, nonfinite_loss=True)).kind == "nonfinite_loss"
    assert detector.check(Signals(1.0, None, nonfinite_grad=True)).kind == "nonfinite_grad"
    assert detector.check(Signals(loss=5.0, grad_norm=5.0)).kind == "loss_spike"
    assert detector.check(Signals(loss=1.0, grad_norm=5.0)).kind == "grad_norm_spike"
    only_nan = Detector(("nonfinite",), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(2.0, 0.5, 1))
    only_nan.accept(Signals(loss=1.0, grad_norm=1.0))
    assert only_nan.check(Signals(loss=50.0, grad_norm=50.0)) is None
    no_nan = Detector(("loss",), LossSpike(5, 1, 1.0, 0.0), GradNormSpike(2.0, 0.5, 1))
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
    assert "over the budget of 100" in store.no_snapshot
    assert "TITAN_REWIND_MAX_HOST_BYTES" in store.no_snapshot


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
