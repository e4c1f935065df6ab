"""The ``TITAN_REWIND_*`` knobs, declared once; the code reads them only through ``.read()``.

The plugin itself is switched by the core's ``TITAN_REWIND=0`` (not declared here). Defaults
were chosen on the CPU demo's loss and grad-norm curves (README, "Defaults"): no trigger in 500
clean steps (one-step grad-norm jumps of 8x and more are healthy there), while a NaN, a tripled
loss or a 30x grad norm are caught at their step.
"""

from __future__ import annotations

from titan_plugins.settings import BYTES, Setting

DETECTORS = ("nonfinite", "loss", "grad_norm")


def _step_list(items: tuple[str, ...]) -> str | None:
    # ASCII digits only, and a step index that fits a training run ("²" and 5000-digit strings
    # pass str.isdigit and then fail int() at activation)
    bad = [item for item in items if not (item.isascii() and item.isdigit() and len(item) <= 12)]
    return f"{', '.join(bad)} not a step index (0, 1, 2, ...)" if bad else None


INTERVAL = Setting(
    "TITAN_REWIND_INTERVAL",
    int,
    10,
    "Take a host snapshot after every this many healthy steps (the first one after step 0; the "
    "starting state, before the first update, is the first rollback target).",
    minimum=1,
)
STABLE_AFTER = Setting(
    "TITAN_REWIND_STABLE_AFTER",
    int,
    5,
    "A snapshot becomes the rollback target once this many healthy steps followed it (the next "
    "snapshot waits until then).",
    minimum=1,
)
MAX_HOST_BYTES = Setting(
    "TITAN_REWIND_MAX_HOST_BYTES",
    BYTES,
    None,
    "Host memory for the two snapshot slots of this process (e.g. 8G), counted with the "
    "optimizer state the first update creates; over it no snapshot is taken, with a warning "
    "naming the size needed.",
    default_text="auto: 25% of RAM / local ranks",
    minimum=1,
)
DETECT = Setting(
    "TITAN_REWIND_DETECT",
    list,
    DETECTORS,
    "Which triggers rewind: nonfinite (NaN/Inf loss or grad norm), loss (spike), grad_norm "
    "(spike).",
    choices=DETECTORS,
)
LOSS_KEY = Setting(
    "TITAN_REWIND_LOSS_KEY",
    str,
    "",
    "Key of the loss in the schedule's per-microbatch reports (empty: 'lm loss' if present, "
    "else the first key).",
    default_text="auto",
)
LOSS_WINDOW = Setting(
    "TITAN_REWIND_LOSS_WINDOW",
    int,
    50,
    "Healthy steps whose global loss forms the median / MAD reference.",
    minimum=5,
)
LOSS_MIN_HISTORY = Setting(
    "TITAN_REWIND_LOSS_MIN_HISTORY",
    int,
    20,
    "Healthy steps seen before the loss-spike check starts (warm-up).",
    minimum=3,
)
LOSS_ZSCORE = Setting(
    "TITAN_REWIND_LOSS_ZSCORE",
    float,
    6.0,
    "A loss spikes when above median + this many robust deviations (1.4826 x MAD, at least "
    "LOSS_MIN_SPREAD x median).",
    minimum=0.5,
)
LOSS_MIN_SPREAD = Setting(
    "TITAN_REWIND_LOSS_MIN_SPREAD",
    float,
    0.05,
    "Floor of the robust deviation as a fraction of the median (a flat curve has MAD ~ 0).",
    minimum=0.0,
)
GRAD_WINDOW = Setting(
    "TITAN_REWIND_GRAD_WINDOW",
    int,
    50,
    "Healthy steps whose grad norms form the rolling median / MAD reference (on logarithms).",
    minimum=5,
)
GRAD_FACTOR = Setting(
    "TITAN_REWIND_GRAD_FACTOR",
    float,
    10.0,
    "A grad norm spikes when above this factor times the median of the last GRAD_WINDOW "
    "healthy grad norms (or more while they move fast, see TITAN_REWIND_GRAD_ZSCORE).",
    minimum=1.0,
)
GRAD_ZSCORE = Setting(
    "TITAN_REWIND_GRAD_ZSCORE",
    float,
    3.0,
    "The grad-norm bar widens to exp(this x 1.4826 x MAD of the window's log norms) x the "
    "median when that is more than GRAD_FACTOR (norms still falling or rising fast).",
    minimum=0.0,
)
GRAD_MIN_HISTORY = Setting(
    "TITAN_REWIND_GRAD_MIN_HISTORY",
    int,
    10,
    "Healthy steps seen before the grad-norm check starts (warm-up).",
    minimum=1,
)
ESCALATE_WINDOW = Setting(
    "TITAN_REWIND_ESCALATE_WINDOW",
    int,
    20,
    "A trigger within this many steps of the previous rewind escalates instead of repeating it.",
    minimum=1,
)
ESCALATE_SKIP = Setting(
    "TITAN_REWIND_ESCALATE_SKIP",
    int,
    10,
    "On escalation, also drop this many further steps of batches per level from the data iterator.",
    minimum=0,
)
MAX_REWINDS = Setting(
    "TITAN_REWIND_MAX_REWINDS",
    int,
    2,
    "Rewinds allowed in one escalation chain; the next trigger raises RewindError naming the "
    "steps.",
    minimum=1,
)
INJECT_NAN_STEP = Setting(
    "TITAN_REWIND_INJECT_NAN_STEP",
    list,
    (),
    "TEST ONLY: comma list of step indices (0-based training calls of this process) whose "
    "first loss-producing microbatch gets a NaN loss.",
    validate=_step_list,
)

SETTINGS: list[Setting] = [
    INTERVAL,
    STABLE_AFTER,
    MAX_HOST_BYTES,
    DETECT,
    LOSS_KEY,
    LOSS_WINDOW,
    LOSS_MIN_HISTORY,
    LOSS_ZSCORE,
    LOSS_MIN_SPREAD,
    GRAD_WINDOW,
    GRAD_FACTOR,
    GRAD_ZSCORE,
    GRAD_MIN_HISTORY,
    ESCALATE_WINDOW,
    ESCALATE_SKIP,
    MAX_REWINDS,
    INJECT_NAN_STEP,
]
