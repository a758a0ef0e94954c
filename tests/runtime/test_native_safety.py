"""Misuse of the native core must not crash the process, and a process that
streams a model must exit cleanly. Everything that could crash or
hang runs in a subprocess with a timeout: a crash is a negative return code
(the signal), a hang a failed test, never a dead or stuck test runner."""
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import layerwise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Imports layerwise from this checkout (not from whatever is installed) and says so.
PRELUDE = textwrap.dedent(
    f"""
    import gc, os, sys
    sys.path.insert(0, {ROOT!r})
    import torch
    torch.set_num_threads(1)
    import layerwise
    assert layerwise.__file__.startswith({ROOT!r}), layerwise.__file__
    """
)


def run_python(code, timeout=120, env=None, argv_prefix=()):
    """Runs `code` (after PRELUDE) in a fresh interpreter; returns the CompletedProcess.
    A hang past `timeout` fails the test, naming the script's output so far."""
    full_env = dict(os.environ)
    full_env.pop("LAYERWISE_DEBUG_COPY_DELAY_US", None)
    full_env.update(env or {})
    cmd = [*argv_prefix, sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"subprocess hung for more than {timeout} s; stdout: {e.stdout!r}; stderr: {e.stderr!r}")


def describe(proc):
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    if rc == 128 + signal.SIGABRT:
        how += " (SIGABRT)"
    return f"{how}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def assert_clean(proc):
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, describe(proc)


# ------------------------------------------------- 1. storages of a queued copy
# Each copy sits behind a few others with up to 1 s of debug delay each, so the
# mutation below happens while it is still queued (checked: the event is not done).
QUEUED_COPY = """
    N = 8 << 20  # above malloc's mmap threshold: a freed buffer is unmapped at once
    eng = layerwise.CopyEngine("cpu", debug_delay_us=1_000_000)
    for rep in range(3):
        scratch = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
        blockers = [eng.copy_async(s, torch.ones(4096, dtype=torch.uint8)) for s in scratch]
        src = torch.randint(0, 256, (N,), dtype=torch.uint8)
        expect = src.clone()
        dst = torch.zeros(N, dtype=torch.uint8)
        ev = eng.copy_async(dst, src)
        assert not ev.query(), "the copy under test ran before the mutation: raise the delay"
        {mutate}
        ev.synchronize()
        {check}
    print("OK")
"""

MUTATIONS = {
    # storage shrunk to nothing under the copy's destination
    "dst_storage_resize_0": (
        """
        try:
            dst.untyped_storage().resize_(0)
            raise SystemExit("resize_ of a storage in flight succeeded")
        except RuntimeError as e:
            assert "not resizable" in str(e), e
        """,
        """
        assert torch.equal(dst, expect)
        dst.untyped_storage().resize_(0)  # resizable again once the copy is done
        assert dst.untyped_storage().nbytes() == 0
        """,
    ),
    # tensor grown, which reallocates its storage
    "dst_resize_grow": (
        """
        try:
            dst.resize_(4 * N)
            raise SystemExit("growing a tensor in flight succeeded")
        except RuntimeError as e:
            assert "not resizable" in str(e), e
        assert dst.untyped_storage().nbytes() == N  # nothing was reallocated
        dst.resize_(N)  # torch keeps the failed shape (as for any fixed-size storage): put it back
        """,
        """
        assert torch.equal(dst, expect)
        dst.resize_(2 * N)
        assert torch.equal(dst[:N], expect)
        """,
    ),
    "src_storage_resize_0": (
        """
        try:
            src.untyped_storage().resize_(0)
            raise SystemExit("resize_ of a source in flight succeeded")
        except RuntimeError as e:
            assert "not resizable" in str(e), e
        """,
        "assert torch.equal(dst, expect)",
    ),
    # the tensor rebound to other storage: its old storage, the copy's target, must live on
    "dst_set_": (
        """
        dst.set_(torch.empty(0, dtype=torch.uint8))
        gc.collect()
        """,
        "assert dst.numel() == 0",
    ),
    "src_set_": (
        """
        src.set_(torch.empty(0, dtype=torch.uint8))
        gc.collect()
        """,
        "assert torch.equal(dst, expect)",
    ),
    # every Python reference dropped: the event alone keeps the storages
    "all_dropped": (
        """
        keep = ev
        del dst, src, ev
        gc.collect()
        ev = keep
        """,
        "",
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_storage_of_a_queued_copy_cannot_be_freed_under_it(mutation):
    mutate, check = MUTATIONS[mutation]
    code = textwrap.dedent(QUEUED_COPY).format(
        mutate=textwrap.indent(textwrap.dedent(mutate).strip(), " " * 4).strip(),
        check=textwrap.indent(textwrap.dedent(check).strip() or "pass", " " * 4).strip(),
    )
    proc = run_python(code, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), describe(proc)


def test_in_flight_marks_are_counted_per_storage():
    # Two copies into one storage: it stays non-resizable until both are done.
    eng = layerwise.CopyEngine("cpu", num_streams=2, debug_delay_us=200_000)
    half = 1 << 15
    refused = 0
    for _ in range(20):
        dst = torch.zeros(2 * half, dtype=torch.uint8)
        a = eng.copy_async(dst[:half], torch.ones(half, dtype=torch.uint8))
        b = eng.copy_async(dst[half:], torch.ones(half, dtype=torch.uint8))
        a.synchronize()
        if not b.query():
            try:
                dst.untyped_storage().resize_(0)
            except RuntimeError as e:
                assert "not resizable" in str(e)
                refused += 1
            else:
                assert b.query(), "a storage was resized while a copy into it was in flight"
                continue  # b finished just before the resize: allowed
        b.synchronize()
        assert int(dst.sum()) == 2 * half
        dst.untyped_storage().resize_(0)  # both done: resizable again
        assert dst.untyped_storage().nbytes() == 0
        if refused >= 2:
            break
    assert refused >= 1, "never caught the second copy in flight: the test proved nothing"


def test_storages_that_were_not_resizable_stay_so():
    eng = layerwise.CopyEngine("cpu")
    arena = layerwise.HostArena(1 << 16, pinned=False)
    blk = arena.allocate(1 << 16)
    src = torch.ones(1 << 16, dtype=torch.uint8)
    eng.copy_async(blk, src).synchronize()
    with pytest.raises(RuntimeError, match="not resizable"):
        blk.untyped_storage().resize_(0)
    src.untyped_storage().resize_(0)  # and what was resizable is so again


# ------------------------------------------------- 2. pin_range bounds
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize(
    "offset,nbytes",
    [(2**62, 2**62), (1, 2**63 - 1), (2**63 - 1, 2**63 - 1), (2**63 - 1, 1), (0, 8193), (8192, 1), (-1, 1), (0, -1)],
)
def test_pin_range_bounds_never_overflow(pinned, offset, nbytes):
    arena = layerwise.HostArena(8192, pinned=pinned, cuda=False)
    with pytest.raises(ValueError, match="outside the arena") as info:
        arena.pin_range(offset, nbytes)
    msg = str(info.value)
    # the message names the values asked for, not a wrapped-around sum
    assert f"offset {offset}" in msg and f"nbytes {nbytes}" in msg and "8192 bytes" in msg, msg
    arena.pin_range(0, 8192)
    arena.pin_range(8192, 0)


@pytest.mark.parametrize("alignment", [2**61, 2**62])
def test_allocate_with_huge_alignment_is_an_error(alignment):
    arena = layerwise.HostArena(8192, pinned=False)
    with pytest.raises((RuntimeError, ValueError), match="exhausted|alignment"):
        arena.allocate(2**63 - 1, alignment=alignment)
    with pytest.raises((RuntimeError, ValueError), match="exhausted|alignment"):
        arena.allocate(16, alignment=alignment)
    assert arena.allocate(16).numel() == 16


# ------------------------------------------------- 3. debug delay is bounded
@pytest.mark.parametrize("bad", [1_000_001, 10**12, 2**63 - 1, -2, -(2**63)])
def test_debug_delay_argument_is_bounded(bad):
    with pytest.raises(ValueError, match=r"debug_delay_us"):
        layerwise.CopyEngine("cpu", debug_delay_us=bad)


@pytest.mark.parametrize(
    "bad", ["1000001", "99999999999999999999999", "-1", "1e3", "0x10", "12abc", "soon", "1.5", " 12", "+5"]
)
def test_debug_delay_env_is_bounded_and_parsed_strictly(monkeypatch, bad):
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", bad)
    with pytest.raises(ValueError, match="LAYERWISE_DEBUG_COPY_DELAY_US"):
        layerwise.CopyEngine("cpu")


def test_debug_delay_limits_that_are_fine(monkeypatch):
    assert layerwise.CopyEngine("cpu", debug_delay_us=1_000_000).debug_delay_us == 1_000_000
    assert layerwise.CopyEngine("cpu", debug_delay_us=0).debug_delay_us == 0
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", "1000000")
    assert layerwise.CopyEngine("cpu").debug_delay_us == 1_000_000
    assert layerwise.CopyEngine("cpu", debug_delay_us=-1).debug_delay_us == 1_000_000  # -1: from the environment
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", "")
    assert layerwise.CopyEngine("cpu").debug_delay_us == 0


# ------------------------------------------------- 4. clean exit, fork
STREAMED_MODEL = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 64)
            self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(6)])

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = torch.relu(b(x))
            return x

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, ref)
"""

EXIT_VARIANTS = {
    "plain": "",
    "del_and_gc": "del model, out\ngc.collect()\n",
    # copies queued behind long debug delays when the interpreter exits, one of
    # them referenced by nothing but its event
    "in_flight": """
        eng = layerwise.CopyEngine("cpu", debug_delay_us=1_000_000)
        evs = [eng.copy_async(torch.empty(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8))
               for _ in range(4)]
        assert not evs[-1].query()
        with torch.no_grad():
            model(x)
    """,
}


def run_exit_script(variant, runs):
    env = {"LAYERWISE_DEBUG_COPY_DELAY_US": "200000"} if variant == "in_flight" else {}
    code = textwrap.dedent(STREAMED_MODEL) + textwrap.dedent(EXIT_VARIANTS[variant])
    with ThreadPoolExecutor(2) as pool:  # two at a time, as the failure was seen
        procs = list(pool.map(lambda _: run_python(code, timeout=120, env=env), range(runs)))
    bad = [p for p in procs if p.returncode != 0 or "terminate called" in p.stderr]
    assert not bad, f"{len(bad)} of {runs} runs of variant {variant!r} did not exit cleanly; first: {describe(bad[0])}"


def test_exit_with_a_streamed_model_is_clean():
    run_exit_script("plain", 40)


@pytest.mark.parametrize("variant", ["del_and_gc", "in_flight"])
def test_exit_variants_are_clean(variant):
    run_exit_script(variant, 12)


def test_engine_after_shutdown_is_a_clear_error():
    proc = run_python(
        """
        eng = layerwise.CopyEngine("cpu", debug_delay_us=1_000_000)
        ev = eng.copy_async(torch.empty(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8))
        layerwise._native._C.shutdown_all()  # what the atexit hook runs
        assert ev.query()  # queued copies are done, not dropped
        for call in (lambda: eng.copy_async(torch.empty(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)),
                     lambda: eng.record(), lambda: eng.wait(ev)):
            try:
                call()
                raise SystemExit("an engine used after shutdown did not raise")
            except RuntimeError as e:
                assert "shut down" in str(e), e
        eng.synchronize()  # nothing is in flight any more: returns (so a late remove() still works)
        layerwise._native._C.shutdown_all()  # twice is fine
        print("OK")
        """,
        timeout=60,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, describe(proc)


FORK = """
    import time
    {child_body_def}
    pid = os.fork()
    if pid == 0:
        try:
            child_body()
        except BaseException as e:
            print("child failed:", repr(e), flush=True)
            os._exit(3)
        sys.exit(0)  # a normal exit: atexit hooks, finalisation, destructors
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise SystemExit("the forked child hung")
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"the forked child ended with {{code}}")
    # The parent's engine and model are untouched by the child.
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model(x), ref)
    print("OK")
"""

FORK_CHILDREN = {
    "del_model": """
        def child_body():
            global model, out
            del model, out
            gc.collect()
    """,
    "forward": """
        def child_body():
            try:
                with torch.no_grad():
                    model(x)
            except RuntimeError as e:
                assert "before fork" in str(e) and "configure" in str(e), e
                print("child error:", e, flush=True)
            else:
                raise AssertionError("a forward in the forked child did not raise")
            # what the error says to do works
            layerwise.remove_layerwise_offload(model)
            layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
            with torch.no_grad():
                assert torch.equal(model(x), ref)
    """,
    "raw_engine": """
        eng = layerwise.CopyEngine("cpu", debug_delay_us=1_000_000)
        queued = [eng.copy_async(torch.empty(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8))
                  for _ in range(3)]

        def child_body():
            eng.synchronize()  # nothing of the parent's engine runs here: returns at once
            for call in (lambda: eng.copy_async(torch.empty(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)),
                         lambda: eng.record(), lambda: eng.wait(queued[0]), lambda: queued[-1].synchronize(),
                         lambda: layerwise.CopyEngine("cpu").copy_async(torch.empty(64, dtype=torch.uint8),
                                                                        torch.ones(64, dtype=torch.uint8),
                                                                        after=queued[-1])):
                try:
                    call()
                except RuntimeError as e:
                    assert "before fork" in str(e), e
                else:
                    if not queued[-1].query():
                        raise AssertionError("a call in the forked child did not raise")
            # a fresh engine in the child works
            e2 = layerwise.CopyEngine("cpu")
            d = torch.zeros(64, dtype=torch.uint8)
            e2.copy_async(d, torch.ones(64, dtype=torch.uint8)).synchronize()
            assert int(d.sum()) == 64
    """,
}


@pytest.mark.parametrize("child", sorted(FORK_CHILDREN))
def test_fork_child_exits_cleanly_and_parent_stays_exact(child):
    code = STREAMED_MODEL + FORK.format(child_body_def=textwrap.indent(textwrap.dedent(FORK_CHILDREN[child]), "    ").strip())
    proc = run_python(code, timeout=120)
    assert_clean(proc)
    assert proc.stdout.strip().endswith("OK"), describe(proc)
    assert "child failed" not in proc.stdout, describe(proc)


# ------------------------------------------------- 5. pinning says what it did
def vm_lck_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    return None


DROP_IPC_LOCK = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "prlimit", "--memlock=8388608:8388608"]


@pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("prlimit")), reason="needs setpriv and prlimit")
def test_pinning_failure_unpins_everything_and_warns_once():
    proc = run_python(
        """
        import resource, warnings
        from layerwise import _native
        assert resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == 8 << 20

        def vmlck():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmLck:")).split()[1])

        cap_eff = int(next(line for line in open("/proc/self/status") if line.startswith("CapEff:")).split()[1], 16)
        assert not cap_eff & (1 << 14), "CAP_IPC_LOCK was not dropped"
        arenas = []
        for _ in range(2):
            a = _native.HostArena(64 << 20, pinned=True, cuda=False)
            # in 1 MiB pieces: the first 8 lock, then the limit is hit
            blocks = [a.allocate(1 << 20) for _ in range(64)]
            for b in blocks:
                b.fill_(1)
            assert a.pinned is False, a.pinned
            assert a.pin_kind == "none", a.pin_kind
            err = a.pin_error
            assert err and "RLIMIT_MEMLOCK" in err and "8.0 MiB" in err and "CAP_IPC_LOCK" in err, err
            assert vmlck() == 0, f"{vmlck()} kB still locked after the failure: a half-locked arena"
            arenas.append((a, blocks))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for a, _ in arenas:
                _native.warn_unpinned(a, "blocks")
        mine = [w for w in caught if issubclass(w.category, _native.LayerwisePinningWarning)]
        assert len(mine) == 1, [str(w.message) for w in caught]
        text = str(mine[0].message)
        for word in ("blocks", "RLIMIT_MEMLOCK", "half", "ulimit -l", "CAP_IPC_LOCK", "pin_memory=False"):
            assert word in text, (word, text)
        # a pageable arena asked for (pin_memory=False) is not a failure
        plain = _native.HostArena(1 << 20, pinned=False)
        assert plain.pin_error is None and plain.pin_kind == "none"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _native.warn_unpinned(plain, "x")
        assert not caught
        print("OK", text)
        """,
        timeout=60,
        argv_prefix=DROP_IPC_LOCK,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, describe(proc)


def test_pinning_within_the_limit_as_root_or_privileged():
    cap_eff = int(next(line for line in open("/proc/self/status") if line.startswith("CapEff:")).split()[1], 16)
    if not cap_eff & (1 << 14):
        pytest.skip("needs CAP_IPC_LOCK (runs as root in CI)")
    before = vm_lck_kb()
    a = layerwise.HostArena(4 << 20, pinned=True, cuda=False)
    blocks = [a.allocate(1 << 20) for _ in range(4)]
    assert a.pinned is True and a.pin_kind == "mlock"
    assert not a.pin_error
    assert vm_lck_kb() - before >= 4 << 10
    del a, blocks
    gc.collect()
    assert vm_lck_kb() == before


def test_pin_error_is_a_read_only_property():
    # The property exists on every arena and is None when nothing went wrong.
    a = layerwise.HostArena(4096, pinned=False)
    assert a.pin_error is None
    with pytest.raises(AttributeError):
        a.pin_error = "x"
    assert re.match(r"^[a-z]+$", a.pin_kind)


@pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("prlimit")), reason="needs setpriv and prlimit")
def test_manager_pinning_explicit_true_refuses_auto_warns_and_report_says_why():
    proc = run_python(
        """
        import copy, warnings
        import torch
        from torch import nn
        import layerwise

        torch.manual_seed(0)
        model = nn.Module()
        model.blocks = nn.ModuleList([nn.Linear(512, 1024) for _ in range(6)])  # ~12.6 MB > the 8 MiB limit
        model.forward = lambda x: [x := b(x[..., :512]) for b in model.blocks][-1]
        ref = copy.deepcopy(model)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            layerwise.configure_layerwise_offload(model, "blocks", device="cpu", pin_memory=True)
            raise SystemExit("pin_memory=True did not refuse")
        except RuntimeError as e:
            assert "pin_memory=True" in str(e) and "RLIMIT_MEMLOCK" in str(e), e
        assert not layerwise.configure.managers_of(model)
        for k, v in model.state_dict().items():
            assert torch.equal(v, sd[k]), k
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layerwise.configure_layerwise_offload(model, "blocks", device="cpu")  # pin_memory="auto"
        assert any("could not be pinned" in str(w.message) for w in caught), [str(w.message) for w in caught]
        x = torch.randn(2, 512)
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        st = layerwise.configure.managers_of(model)[0].stats()
        assert st["arena_pinned"] is False and "RLIMIT_MEMLOCK" in st["arena_pin_error"], st
        text = str(layerwise.report(model))
        assert "NOT pinned" in text and "RLIMIT_MEMLOCK" in text, text
        print("OK")
        """,
        timeout=120,
        argv_prefix=DROP_IPC_LOCK,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, describe(proc)
