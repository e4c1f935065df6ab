"""The native scanner (``_native.c``) reads exactly what the reader's Python loop reads.

Compared event by event (the fields ``OpBuilder.gpu_event`` takes, launch records, counts,
truncation) on randomised traces built to hit every branch (key orders, spacing, escapes,
non-ASCII, numbers orjson and C could disagree on, duplicate keys, launch layouts the fast
regex skips, events cut inside strings, damaged and cut files), on byte-mutated traces, and
summary by summary on generated multi-rank sets and HTA's real traces.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import gen_traces
import pytest
from titan_trace_analysis import fastpath
from titan_trace_analysis import summarize as summarize_module
from titan_trace_analysis.drops import MAX_DUR, MAX_TS
from titan_trace_analysis.ops import GPU_CATS, Op, OpBuilder
from titan_trace_analysis.reader import MAX_STRING, TraceReader
from titan_trace_analysis.summarize import Options, summarize

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

HTA = Path(__file__).resolve().parent / "data" / "hta"


def _can_build() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    header = Path(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which(cc) is not None and header.is_file()


NATIVE = fastpath.native_scan() is not None
CAN_BUILD = _can_build()
needs_native = pytest.mark.skipif(not NATIVE, reason="native scanner not built (no C compiler)")
needs_compiler = pytest.mark.skipif(
    not CAN_BUILD, reason="no C compiler or Python headers here: the Python loop is the reader"
)


@needs_compiler
def test_the_scanner_is_built_wherever_it_can_be():
    """An install with a C compiler and Python's headers must have built it (the setup marks
    it optional so installs elsewhere still succeed, which would otherwise hide a failure)."""
    assert NATIVE, "titan_trace_analysis._native missing: reinstall titan-trace-analysis"
    assert fastpath.reader_name() == "native+" + fastpath.codec().name
    assert fastpath.reader_name(pure=True) == "stdlib"


def test_an_extension_built_from_older_source_is_left_unused(monkeypatch):
    """An editable checkout whose extension was not rebuilt has another scan(): the reader
    reads with its Python loop instead (same results) and --version says why."""

    class Old:  # a module from older source: no API constant, a scan of three arguments
        @staticmethod
        def scan(buf: bytes, hold: int, launches: dict) -> None:
            raise AssertionError("a stale scan() was called")

    monkeypatch.setattr(fastpath, "_native", Old)
    assert fastpath.native_scan() is None and fastpath.native_stale()
    assert "native extension out of date: reinstall" in fastpath.reader_name()


def _norm(ev: Any) -> tuple:
    """An item of ``records()`` as the analysis sees it (the fields gpu_event takes)."""
    if type(ev) is tuple:
        cat, ts, dur, name, corr, args = ev
        return (
            "gpu",
            cat,
            repr(ts),
            repr(dur),
            name,
            corr,
            None if args is None else json.loads(args),
        )
    cat = ev.get("cat")
    if cat in GPU_CATS:
        try:
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            return ("dict", json.dumps(ev, sort_keys=True))
        args = ev.get("args") if type(ev.get("args")) is dict else None
        corr = args.get("correlation") if args is not None else None
        corr = corr if type(corr) is int and corr >= 0 else None
        return ("gpu", cat, repr(ts), repr(dur), ev.get("name", ""), corr, args)
    return ("dict", json.dumps(ev, sort_keys=True))


def _read(path: Path, native: bool, block: int | None) -> tuple:
    reader = TraceReader(str(path), native=native, block=block)
    items: list[tuple] = []
    try:
        for batch in reader.records():
            items += map(_norm, batch)
    except Exception as exc:  # both loops must fail the same way
        return ("raised", type(exc).__name__, str(exc))
    launches = [(k, repr(v[0]), v[1]) for k, v in reader.launches.items()]
    return (items, launches, reader.n_events, reader.bad_events, reader.truncated,
            reader.damage, json.dumps(reader.header, sort_keys=True))  # fmt: skip


def _same(path: Path, block: int | None) -> tuple:
    python, native = _read(path, False, block), _read(path, True, block)
    assert native == python, f"{path} (block {block}) reads differently"
    return python


# ---- randomised events ----

# usual values, and values that stress the parsers (escapes, non-ASCII, non-strings, numbers
# orjson and C could read differently): the odd ones now and then, so most events stay usual
NAMES = ['"k"', '"void at::native::vectorized_elementwise_kernel<4, float>(int)"',
         '"ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"', '""',
         '"ncclKernel_AllReduce_RING_LL_Sum_float"', '"Memcpy DtoH (Device -> Pinned)"']  # fmt: skip
ODD_NAMES = ['"k<{a}, {b}>"', '"q\\"uote"', '"caf\xc3\xa9"', '"\\u00e9t\\u00e9"',
             '"\\ud83d\\ude00"', "7", "null"]  # fmt: skip
NUMBERS = ["0", "5", "17", "1.5", "1696875284613337", "1696875284613337.25", "1.5e3", "1E+2",
           "2.5e-7", "0.1", "1e99", "12345678901234567", "-0", "-3", "-0.0"]  # fmt: skip
ODD_NUMBERS = ["1e400", "123456789012345678901234", "1e100", "01", "1.", '"12"', "true",
               "null", "[1]"]  # fmt: skip
CORRS = ["12", "0", "-0", "-4", "4.0", '"9"', "123456789012345678", "1234567890123456789", "null"]
CATS = ['"kernel"', '"gpu_memcpy"', '"gpu_memset"', '"cuda_runtime"', '"cuda_driver"',
        '"musa_runtime"', '"cpu_op"', '"user_annotation"', '"gpu_user_annotation"',
        '"python_function"', '"ker\\u006eel"']  # fmt: skip
TITLES = ['"ProfilerStep#3"', '"nccl:send 0->1"', '"gloo:recv"', '"titan.p2p:recv_forward"',
          '"aten::mm"', '"ProfilerStep#x"', '"mccl:all_reduce"']  # fmt: skip
SPACES = ["", " ", "  ", "\n", "\t", "\r\n  "]


def _obj(rng: random.Random, members: list[tuple[str, str]]) -> str:
    rng.shuffle(members)
    sp = lambda: rng.choice(SPACES)  # noqa: E731
    key = lambda k: f'"{k}"' if "\\" in k else json.dumps(k)  # noqa: E731 (escapes as given)
    body = ("," + sp()).join(f"{sp()}{key(k)}{sp()}:{sp()}{v}" for k, v in members)
    return "{" + body + sp() + "}"


def _args(rng: random.Random) -> str:
    members = [("External id", str(rng.randint(0, 999))), ("stream", "7"), ("grid", "[1, 2, 3]")]
    if rng.random() < 0.01:  # cut in two by the reader: its buffer goes to the Python loop
        members.append(("notes", '"a}, {b"'))
    if rng.random() < 0.85:
        members.append(("correlation", rng.choice(CORRS) if rng.random() < 0.3 else "77"))
    if rng.random() < 0.1:
        members.append(("correlation", rng.choice(CORRS)))  # duplicate: the last wins
    if rng.random() < 0.1:
        members.append(("nested", '{"correlation": 99, "deep": [[{"x": {}}]]}'))
    if rng.random() < 0.05:
        members.append(("corr\\u0065lation", "77"))  # spells "correlation" escaped
    if rng.random() < 0.05:
        members.append(("Process Group Name", '"0"'))
    return _obj(rng, members)


def _number(rng: random.Random, usual: str) -> str:
    r = rng.random()
    return rng.choice(ODD_NUMBERS) if r < 0.04 else rng.choice(NUMBERS) if r < 0.4 else usual


def _gpu(rng: random.Random) -> str:
    members = [("ph", '"X"'), ("cat", rng.choice(CATS[:3] if rng.random() < 0.8 else CATS)),
               ("pid", "0"), ("tid", "7")]  # fmt: skip
    if rng.random() < 0.97:
        members.append(("name", rng.choice(ODD_NAMES if rng.random() < 0.06 else NAMES)))
    if rng.random() < 0.98:
        members.append(("ts", _number(rng, str(rng.randint(0, 10**6)))))
    if rng.random() < 0.9:
        members.append(("dur", _number(rng, str(rng.randint(0, 500)))))
    r = rng.random()
    if r < 0.8:
        members.append(("args", _args(rng)))
    elif r < 0.85:
        members.append(("args", rng.choice(['"x"', "[]", "null", "3"])))
    if rng.random() < 0.05:
        members.append(("cat", rng.choice(CATS)))  # a duplicate "cat": the last wins
    if rng.random() < 0.03:
        members.append(("args", _args(rng)))
    return _obj(rng, members)


def _launch(rng: random.Random, odd: bool = False) -> str:
    ts = rng.choice([str(rng.randint(0, 10**6)), "1.5e3", "1e999", "-7", "2.", "3E-2"])
    if odd and rng.random() < 0.02:
        ts = rng.choice(["1e", "1.2.3", "-", "1e5e"])  # float() refuses: one bad event
    corr = rng.choice(["12", "0", str(rng.randint(0, 10**5))])
    corr = "1234567890123456789" if rng.random() < 0.01 else corr  # > 18 digits: Python reads
    tid = "12345678901234567890" if rng.random() < 0.01 else rng.choice(["7", "8"])  # > int64
    cat = rng.choice(['"cuda_runtime"', '"cuda_driver"', '"musa_runtime"', '"musa_driver"'])
    args = f'{{"External id": 3, "cbid": 211, "correlation": {corr}}}'
    if rng.random() < 0.7:  # Kineto's layout: tid, ts, ..., args
        sp = rng.choice(SPACES)
        pre = (
            '"pre": {"tid": 3, "ts": 4, "x": {}}, ' if rng.random() < 0.1 else ""
        )  # skipped by LAUNCH
        return (f'{{"ph": "X", "cat": {cat}, "name": "cudaLaunchKernel", {pre}"pid": 0,{sp}"tid":'
                f'{sp}{tid},{sp}"ts": {ts}, "dur": 4, "args": {args}}}')  # fmt: skip
    members = [("ph", '"X"'), ("cat", cat), ("name", '"cudaLaunchKernel"'), ("tid", tid),
               ("ts", ts), ("args", args)]  # fmt: skip
    return _obj(rng, members)


def _annotation(rng: random.Random) -> str:
    cat = rng.choice(['"user_annotation"', '"cpu_op"', '"gpu_user_annotation"'])
    members = [("ph", '"X"'), ("cat", cat), ("name", rng.choice(TITLES)), ("pid", "0"),
               ("tid", "7"), ("ts", str(rng.randint(0, 10**6))), ("dur", "9")]  # fmt: skip
    return _obj(rng, members)


def _other(rng: random.Random) -> str:
    valid = [
        '{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 5, "dur": 1, "args": {}}',
        '{"ph": "X", "cat": "python_function", "name": "f", "ts": 1, "dur": 1}',
        '{"ph": "M", "name": "process_name", "args": {"name": "python"}}',
        "{}",
    ]
    invalid = [  # each sends its buffer to the Python loop (a retry with its neighbours)
        '{"ph": "X", "cat": "kernel", "name": "bad", "ts": }',
        '{"ph": "X", "cat": "kernel", "name": "k", "ts": NaN, "dur": 1}',
        '{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {}}}',
        '{"ph": "X", "cat": "kernel",\x0c"name": "k", "ts": 1, "dur": 1}',  # \f, \v: not JSON
        '{"ph": "X", "cat": "kernel", "name": "k", "ts":\x0b1, "dur": 1}',  # spacing
        '{"ph": "X", "cat": "kernel", "name": "k\x01", "ts": 1, "dur": 1}',
        '{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {"a": tru}}',
        '{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {"a": [1,]}}',
    ]
    return rng.choice(invalid if rng.random() < 0.2 else valid)


def _trace_text(rng: random.Random, n: int, odd: bool = False) -> str:
    makers = [(_gpu, 0.45), (lambda r: _launch(r, odd), 0.25), (_annotation, 0.12), (_other, 0.08)]
    events = []
    for _ in range(n):
        r, acc = rng.random(), 0.0
        for make, w in makers:
            acc += w
            if r < acc:
                events.append(make(rng))
                break
        else:
            events.append(_gpu(rng))
    joints = [", ", ",", ",\n", " ,\t"]  # "}, {" boundaries as writers space them
    body = "".join(e if i == 0 else rng.choice(joints) + e for i, e in enumerate(events))
    head = '{"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ['
    return head + body + '], "displayTimeUnit": "ms"}'


def _write(path: Path, text: bytes, gz: bool) -> Path:
    if gz:
        path = path.with_suffix(".json.gz")
        path.write_bytes(gzip.compress(text))
    else:
        path.write_bytes(text)
    return path


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_randomised_traces_read_the_same(tmp_path: Path, seed: int):
    rng = random.Random(seed)
    text = _trace_text(rng, 600).encode()
    whole = _write(tmp_path / "t.json", text, gz=seed % 2 == 0)
    for block in (97, 512, 4096, None):
        items, launches, n_events, *_ = _same(whole, block)
        assert n_events > 500 and items and launches  # the loops read something
    native = [ev for b in TraceReader(str(whole), native=True, block=97).records() for ev in b]
    assert sum(type(ev) is tuple for ev in native) > len(native) // 3  # the C path did read
    odd = _write(tmp_path / "odd.json", _trace_text(rng, 600, odd=True).encode(), gz=False)
    got = _same(odd, 301)  # a launch time float() refuses: counted, the rest read
    assert got[0] != "raised"
    cut = _write(
        tmp_path / "cut.json", text[: rng.randint(len(text) // 3, len(text) - 10)], gz=False
    )
    for block in (97, 1024):
        got = _same(cut, block)
        assert got[4]  # truncated


@needs_native
def test_the_native_scanner_hands_over_what_it_cannot_vouch_for(tmp_path: Path):
    """Tuples only for clean GPU events; everything else reaches Python as before, and so do
    the events Python drops (it counts why): times out of range, no integer pid / tid."""
    ids = '"pid": 0, "tid": 7'
    events = [
        '{"ph": "X", "cat": "kernel", "name": "k1", %s, "ts": 10, "dur": 2, "args": {"correlation": 5}}',
        '{"ph": "X", "cat": "kernel", "name": "k\\u00e9", %s, "ts": 10, "dur": 2, "args": {}}',
        '{"ph": "X", "cat": "gpu_memcpy", "name": "m", %s, "ts": 1.5e3, "args": {"correlation": -0}}',
        '{"ph": "X", "cat": "kernel", "name": "k3", %s, "ts": 123456789012345678901, "dur": 1}',
        '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", %s, "ts": 1, "dur": 50}',
        '{"ph": "X", "cat": "kernel", "name": "k4", "pid": 0, "ts": 10, "dur": 2}',
        '{"ph": "X", "cat": "kernel", "name": "k5", "pid": 0, "tid": "7", "ts": 10, "dur": 2}',
        '{"ph": "X", "cat": "kernel", "name": "k6", %s, "ts": 10, "dur": -2}',
        '{"ph": "X", "cat": "kernel", "name": "k7", %s, "ts": 1e18, "dur": 2}',
    ] * 4  # fmt: skip
    text = '{"traceEvents": [' + ", ".join(e.replace("%s", ids) for e in events) + "]}"
    path = _write(tmp_path / "t.json", text.encode(), gz=False)
    reader = TraceReader(str(path), native=True, block=64)
    items = [ev for batch in reader.records() for ev in batch]
    kinds = [type(ev).__name__ for ev in items]
    assert kinds[:9] == ["tuple", "dict", "tuple", "dict", "dict", "dict", "dict", "dict", "dict"]
    assert items[0] == ("kernel", 10.0, 2.0, "k1", 5, b'{"correlation": 5}')
    assert items[2] == ("gpu_memcpy", 1500.0, 0.0, "m", 0, b'{"correlation": -0}')
    assert items[1]["name"] == "ké" and items[3]["ts"] == 1.2345678901234568e20  # orjson: a float
    _same(path, 64)


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_mutated_traces_read_the_same(tmp_path: Path, seed: int):
    """Random byte edits (structure characters, digits, quotes) anywhere in a trace."""
    rng = random.Random(1000 + seed)
    base = bytearray(_trace_text(rng, 150, odd=True).encode())
    alphabet = b'{}[],:"\\ 0123456789.eE-+ntu\n\x0c\x0b\xc3'
    for trial in range(25):
        text = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(text))
            op = rng.random()
            if op < 0.4:
                text[pos] = rng.choice(alphabet)
            elif op < 0.7:
                del text[pos]
            else:
                text.insert(pos, rng.choice(alphabet))
        path = _write(tmp_path / f"m{trial}.json", bytes(text), gz=False)
        _same(path, rng.choice([64, 211, 1500]))


def _summaries_agree(path: str) -> dict:
    orig = summarize_module.TraceReader

    def python_loop(*args: Any, **kwargs: Any) -> TraceReader:
        return orig(*args, **{**kwargs, "native": False})

    native = summarize(path, options=Options())
    summarize_module.TraceReader = python_loop  # type: ignore[assignment,misc]
    try:
        python = summarize(path, options=Options())
    finally:
        summarize_module.TraceReader = orig  # type: ignore[misc]
    native.pop("timeline", None), python.pop("timeline", None)
    assert native == python, path
    return native


@needs_native
def test_generated_sets_summarise_the_same(tmp_path: Path):
    out = tmp_path / "t"
    gen_traces.generate(["--out", str(out), "--ranks", "8", "--pp", "2", "--layers", "2",
                         "--steps", "3", "--slow-stages", "1", "--no-collective-args"])  # fmt: skip
    files = sorted(out.glob("*.json*"))
    for f in files[:4]:
        s = _summaries_agree(str(f))
        assert s["status"] == "ok" and s["steps"]
    data = (
        gzip.decompress(files[0].read_bytes())
        if files[0].suffix == ".gz"
        else files[0].read_bytes()
    )
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: len(data) * 2 // 3])
    s = _summaries_agree(str(cut))
    assert s["truncated"] and s["steps"]


@needs_native
def test_hta_real_traces_summarise_the_same():
    files = [p for p in HTA.rglob("*.json*") if p.is_file() and p.name != "hta_0.5.0_temporal.json"]
    assert len(files) >= 4, files
    for f in files:
        _summaries_agree(str(f))
    assert os.path.getsize(max(files, key=os.path.getsize)) > 1 << 20  # past a read or two


def _built(path: Path, take: Any, block: int) -> tuple:
    """Everything OpBuilder keeps after taking every batch of ``path``: with ``take``, the
    native reader's records; without, the Python reader's dicts through ``gpu_event``."""
    b = OpBuilder(take)
    rest = []
    for batch in TraceReader(str(path), native=take is not None, block=block).records():
        rest += b.batch(batch)
    state = (b.gpu, sorted(b.names.items()), sorted(b._klass.items()), b.raw_comm,
             sorted(b.drops.pairs.items()))  # fmt: skip
    return repr(state), json.dumps(rest, sort_keys=True)


@needs_native
def test_the_native_builder_loop_builds_what_the_python_loop_builds(tmp_path: Path):
    """``_native.take`` on the native reader's records against the Python reader's dicts
    through ``gpu_event``: the same Ops (repr: bit for bit), names totals, kernel classes,
    communication args, drops by reason and kind, and leftover events, in the same order."""
    take = fastpath.native_take()
    files = []
    for seed in range(4):
        text = _trace_text(random.Random(50 + seed), 800).encode()
        files.append(_write(tmp_path / f"r{seed}.json", text, gz=False))
    out = tmp_path / "g"
    gen_traces.generate(["--out", str(out), "--ranks", "4", "--pp", "2", "--layers", "2",
                         "--steps", "2"])  # fmt: skip
    files += sorted(out.glob("*.json*"))[:2]
    files += [p for p in HTA.rglob("*.json*") if "critical_path" in str(p)][:1]
    for f in files:
        python, native = _built(f, None, 700), _built(f, take, 700)
        assert native == python, f
        assert "Op(start=" in python[0]  # something was built


@needs_native
def test_kernel_names_are_shared_and_exact_past_the_name_cache(tmp_path: Path):
    """The scanner hands out one str per kernel name (a bounded cache in C): 3000 distinct
    names (three times its slots: replacements), names of 1 to 5000 bytes (past its size
    limit) and repeats read exactly as the Python loop reads them; repeats of a cached name
    are the same object."""
    rng = random.Random(7)
    names = [f"k{i}_" + "x" * rng.choice([0, 5, 300, 2047, 2048, 2049, 5000]) for i in range(3000)]
    order = names + [rng.choice(names) for _ in range(3000)]
    events = [f'{{"ph": "X", "cat": "kernel", "name": "{n}", "pid": 1, "tid": 7, "ts": {i}.5, '
              f'"dur": 2, "args": {{"correlation": {i}}}}}' for i, n in enumerate(order)]  # fmt: skip
    path = _write(tmp_path / "names.json", ('{"traceEvents": [' + ", ".join(events) + "]}").encode(),
                  gz=False)  # fmt: skip
    _same(path, None)
    _same(path, 4096)  # names cut across reads
    items = [ev for batch in TraceReader(str(path), native=True).records() for ev in batch]
    assert sum(type(ev) is tuple for ev in items) > 5000  # the scanner read them, not Python
    assert [ev[3] if type(ev) is tuple else ev["name"] for ev in items] == order
    repeated = '"ph": "X", "cat": "kernel", "name": "gemm", "pid": 1, "tid": 7, "ts": 1, "dur": 1'
    path = _write(tmp_path / "same.json",
                  ('{"traceEvents": [' + ", ".join(["{" + repeated + "}"] * 3000) + "]}").encode(),
                  gz=False)  # fmt: skip
    got = [ev[3] for batch in TraceReader(str(path), native=True).records() for ev in batch
           if type(ev) is tuple]  # fmt: skip
    assert len(got) > 2000 and len({id(n) for n in got}) == 1 and got[0] == "gemm"


WITHOUT_EXTENSION = """
import json, sys
sys.modules["titan_trace_analysis._native"] = None  # import -> ImportError: built without a compiler
from titan_trace_analysis import fastpath, intervals
from titan_trace_analysis.summarize import summarize
assert fastpath.native_scan() is None and intervals._any is None, fastpath.reader_name()
print(json.dumps({"reader": fastpath.reader_name(), "summary": summarize(sys.argv[1])}))
"""


@needs_native
def test_an_install_without_the_extension_reads_the_same(tmp_path: Path):
    out = tmp_path / "t"
    gen_traces.generate(["--out", str(out), "--ranks", "4", "--pp", "2", "--layers", "2",
                         "--steps", "2", "--slow-ranks", "1"])  # fmt: skip
    path = str(sorted(out.glob("*.json*"))[1])
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSION, path], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["reader"] == fastpath.codec().name  # no "native+"
    native = summarize(path)
    assert native["status"] == "ok" and native["steps"]
    assert got["summary"] == json.loads(json.dumps(native))


@needs_native
@needs_compiler
def test_the_scalar_build_scans_as_the_simd_build(tmp_path: Path):
    """The portable code path (CPUs without SSE2, e.g. aarch64) compiled here with
    -DTITAN_SCAN_SCALAR gives what the installed (SSE2) build gives, buffer by buffer."""
    from titan_trace_analysis import _native

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    so = tmp_path / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    src = Path(_native.__file__).with_name("_native.c")
    include = sysconfig.get_paths()["include"]
    cmd = [
        cc,
        "-O2",
        "-DTITAN_SCAN_SCALAR",
        "-shared",
        "-fPIC",
        f"-I{include}",
        str(src),
        "-o",
        str(so),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    spec = importlib.util.spec_from_file_location("_native", so)
    scalar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scalar)  # type: ignore[union-attr]
    for seed in range(6):
        text = _trace_text(random.Random(300 + seed), 400).encode()
        body = text[text.index(b"[") + 2 :]
        for cut in range(0, len(body), 997):
            buf = body[cut : cut + 4000]
            a, b = {}, {}
            limits = (MAX_TS, MAX_DUR, MAX_STRING)
            assert scalar.scan(buf, 4, a, *limits) == _native.scan(buf, 4, b, *limits) and a == b


@needs_native
def test_the_c_step_assignment_equals_the_python_loop():
    """``_native.assign`` (steps.assign): the same ops in the same buckets, boundaries included."""
    from titan_trace_analysis import steps
    from titan_trace_analysis.ops import Op

    assert steps._native is not None
    rng = random.Random(7)
    step_list = [(n, 100.0 * n, 100.0 * n + 90.0) for n in range(1, 6)]
    starts, ends = [s[1] for s in step_list], [s[2] for s in step_list]
    launches = {}
    ops = []
    for i in range(3000):
        start = rng.choice([rng.uniform(0, 700), 100.0, 190.0, 200.0, 590.0, 50.0, 650.0])
        corr = rng.choice([None, i, i, -1])
        if corr is not None and rng.random() < 0.8:
            launches[corr] = (rng.choice([start - 3.0, 290.0, 300.0, 95.0, 1e9]), 7)
        ops.append(Op(start, start + 2.0, 1, "", corr, "", -1))
    got = steps.assign(step_list, ops, launches)
    assert got == steps.assign_py(starts, ends, ops, launches)
    assert sum(map(len, got)) > 1000 and all(got)
    ints = [o._replace(start=int(o.start)) for o in ops]  # not floats: the Python loop decides
    assert steps.assign(step_list, ints, {}) == steps.assign_py(starts, ends, ints, {})


def test_a_launch_time_float_refuses_costs_that_event_not_the_file(tmp_path: Path):
    """A launch record whose time matches the fast pattern but is no number ("1e5e") is one bad
    event (it made the whole file unreadable before), with and without the extension."""
    events = [
        '{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 7, '
        '"ts": 1e5e, "dur": 4, "args": {"correlation": 9}}',
        '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 0, "tid": 7, '
        '"ts": 0, "dur": 100}',
        '{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5, '
        '"args": {"correlation": 3}}',
    ]
    path = tmp_path / "rank-0.json"
    path.write_text(
        '{"distributedInfo": {"rank": 0}, "traceEvents": [' + ", ".join(events * 3) + "]}"
    )
    for native in (False, True) if NATIVE else (False,):
        reader = TraceReader(str(path), native=native, block=64)
        items = [ev for batch in reader.records() for ev in batch]
        assert reader.bad_events == 3 and len(items) == 6, (native, reader.bad_events)
    s = summarize(str(path))
    assert s["status"] == "partial" and s["steps"] and not s.get("truncated")
    assert any("3 events dropped" in p and "3 launches" in p for p in s["problems"])


def test_a_damaged_event_at_the_end_is_not_a_cut_file(tmp_path: Path):
    """The array's end is found by what follows it, so an unparsable event among the last ones
    is one bad event; the events after it are kept and the file is not marked truncated."""
    good = '{"ph": "X", "cat": "kernel", "name": "k", "ts": %d, "dur": 1, "args": {}}'
    events = [good % i for i in range(6)]
    events[-2] = '{"ph": "X", "cat": "kernel", "name": "bad", "ts": }'
    for trailer in ("}", ', "displayTimeUnit": "ms"}\n', ""):
        path = tmp_path / "t.json"
        path.write_text('{"traceEvents": [' + ", ".join(events) + "]" + trailer)
        reader = TraceReader(str(path))
        items = [ev for batch in reader.records() for ev in batch]
        names = [ev["name"] if isinstance(ev, dict) else ev[3] for ev in items]
        assert names == ["k"] * 5 and reader.bad_events == 1 and not reader.truncated, trailer
    path.write_text('{"traceEvents": [' + ", ".join(events))  # really cut: salvaged
    reader = TraceReader(str(path))
    assert len([ev for b in reader.records() for ev in b]) == 4 and reader.truncated


def test_the_collector_pause_is_shared_by_threads():
    """summarize pauses the process-wide cyclic collector; threads share one pause and the
    last one out restores what was there before."""
    import gc
    import threading

    from titan_trace_analysis import summarize as summ

    assert gc.isenabled()
    inside = threading.Barrier(2)
    seen = []

    def worker() -> None:
        summ._pause_gc()
        inside.wait()
        seen.append(gc.isenabled())
        inside.wait()
        summ._resume_gc()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    summ._pause_gc()  # a third summary still running when the threads end
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [False, False] and not gc.isenabled()
    summ._resume_gc()
    assert gc.isenabled()
    gc.disable()  # paused by someone else: left paused
    summ._pause_gc()
    summ._resume_gc()
    assert not gc.isenabled()
    gc.enable()


@needs_native
def test_c_built_ops_are_ordinary_ops(tmp_path: Path):
    """Ops made by _native.take hash, compare and pickle like Ops made in Python."""
    import pickle

    text = _trace_text(random.Random(5), 300).encode()
    path = _write(tmp_path / "t.json", text, gz=False)
    b = OpBuilder(fastpath.native_take())
    for batch in TraceReader(str(path), native=True, block=700).records():
        b.batch(batch)
    assert b.gpu
    for op in b.gpu:
        twin = Op(*op)
        assert op == twin and hash(op) == hash(twin)
        assert repr(pickle.loads(pickle.dumps(op))) == repr(op)  # (a pickled nan is another nan)
    assert len(set(b.gpu) | {Op(*o) for o in b.gpu}) == len(set(b.gpu))


@needs_native
def test_the_c_union_refuses_what_sorted_refuses():
    from titan_trace_analysis import _native

    assert _native.union_any([(1.0, 2.0), [0.0, 1.0]], 0.0) is None  # sorted() would raise
    assert _native.union_any([[1.0, 2.0], [0.0, 1.0]], 0.0) == [[0.0, 2.0]]
    with pytest.raises(TypeError):
        from titan_trace_analysis import intervals

        intervals.union([(1.0, 2.0), [0.0, 1.0]])
