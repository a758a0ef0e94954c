"""One process of the rendezvous tests (tests/runtime/test_rendezvous.py): N of
these meet through layerwise/runtime/rendezvous.py with a small sealed memfd as
the "arena", and print what they saw ("role packer", "inode DEV:INO", "peer PID",
"holders K", ...) for the test to compare across processes.

    python tests/helpers/share_worker.py INDEX N TMPDIR SCENARIO NAME

Barriers are files in TMPDIR (`touch`/`wait_for`). The worker prints "rank R ok"
when its scenario passed.
"""
import fcntl
import hashlib
import importlib.util
import logging
import os
import stat
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_rendezvous():
    # rendezvous.py imports only the standard library; loading it by path spares each
    # worker the seconds of importing torch through the layerwise package.
    spec = importlib.util.spec_from_file_location("layerwise_rendezvous", ROOT / "layerwise/runtime/rendezvous.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


rv = _load_rendezvous()

PAGES = 3
SIZE = PAGES * 4096
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def say(*words):
    print(*words, flush=True)


def touch(tmp, name):
    (tmp / name).write_text(str(os.getpid()))


def wait_for(tmp, *names, timeout=60.0):
    end = time.monotonic() + timeout
    while not all((tmp / n).exists() for n in names):
        assert time.monotonic() < end, f"barrier {names} not reached in {timeout} s"
        time.sleep(0.01)


def wait_until(check, what, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < end, f"{what}: not reached in {timeout} s"
        time.sleep(0.01)


def pattern(name):
    return (hashlib.sha256(name.encode()).digest() * (SIZE // 32 + 1))[:SIZE]


def make_arena(name):
    """A sealed memfd holding the name's pattern (what shared_arena.py makes for real)."""
    fd = os.memfd_create(f"layerwise-test:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.pwrite(fd, pattern(name), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def inode(fd):
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


class Arena:
    def __init__(self, fd):
        self.fd = fd
        self.inode = inode(fd)


def validator(name):
    def validate(fd):
        st = os.fstat(fd)
        link = os.readlink(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 0 or st.st_size != SIZE:
            raise ValueError(f"fd {fd} ({link}) is not an unlinked file of {SIZE} bytes")
        if not link.startswith(f"/memfd:layerwise-test:{name}"):
            raise ValueError(f"fd {fd} is {link}, not the test's memfd")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise ValueError(f"fd {fd} ({link}) is not sealed")
        if os.pread(fd, SIZE, 0) != pattern(name):
            raise ValueError(f"fd {fd} ({link}) does not hold the pattern")
        return Arena(fd)
    return validate


def memfds():
    """The test memfds this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:layerwise-test:" in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(int(fd))
        except OSError:
            pass
    return found


def join(name, **kw):
    """Join; a packer packs and publishes. Prints the role, the inode and the peer."""
    m = rv.join(name, validate=validator(name), **kw)
    say(f"role {m.role}")
    if m.role == "packer":
        say("packing")
        fd = make_arena(name)
        m.publish(fd)
        m.arena = Arena(fd)
    else:
        assert m.role == "attached", m
        m.arena = m.value
        say(f"peer {m.peer_pid}")
    say(f"inode {m.arena.inode}")
    return m


def pids(tmp, *idx):
    return {int((tmp / f"pid.{i}").read_text()) for i in idx}


# ---- scenarios: (index, n, tmp, name) -------------------------------------------
def scenario_together(i, n, tmp, name):
    """n processes join at once: one packs, all hold the same inode."""
    touch(tmp, f"ready.{i}")
    wait_for(tmp, *(f"ready.{k}" for k in range(n)))
    m = join(name)
    touch(tmp, f"done.{i}")
    wait_for(tmp, *(f"done.{k}" for k in range(n)))  # the packer serves until all attached
    m.leave()


def scenario_kill_packing(i, n, tmp, name):
    """Worker 0 packs first and is SIGKILLed at "packing", with the others waiting
    on it; they elect again and exactly one of them packs."""
    if i == 0:
        m = rv.join(name, validate=validator(name))
        assert m.role == "packer", m
        touch(tmp, "elected.0")
        wait_until(lambda: len(m._state.conns) == n - 1, "all others waiting")
        say("packing")
        time.sleep(60)
        return
    wait_for(tmp, "elected.0")
    m = join(name)
    others = [f"done.{k}" for k in range(1, n)]
    touch(tmp, f"done.{i}")
    wait_for(tmp, *others)
    m.leave()


def scenario_kill_server(i, n, tmp, name, offer=False):
    """Worker 0 packs and serves 1 and 2, then is SIGKILLed at "serving"; worker 3,
    joining only after that, attaches to the same inode, served by 1 or 2. With offer,
    the holders bind again only after 3 won the bind: 3 takes a holder's OFFER."""
    touch(tmp, f"pid.{i}")
    if i == 0:
        m = join(name)
        touch(tmp, "published.0")
        wait_for(tmp, "attached.1", "attached.2")
        say("serving")
        time.sleep(60)
        return
    if i in (1, 2):
        wait_for(tmp, "published.0")
        m = join(name)
        assert m.peer_pid in pids(tmp, 0), m
        if offer:
            bind = rv._try_bind

            def bind_after_the_newcomer(addr):
                if threading.current_thread().name == "layerwise-rendezvous":
                    touch(tmp, f"eof.{i}")
                    wait_for(tmp, "bound.3")
                return bind(addr)
            rv._try_bind = bind_after_the_newcomer
        touch(tmp, f"attached.{i}")
        if offer:
            wait_for(tmp, "joined.3")
            say(f"holders {wait_until(lambda: m.holders() == 3 and 3, 'three holders with the newcomer')}")
        else:
            say(f"holders {wait_until(lambda: m.holders() == 2 and 2, 'two holders after the server died')}")
            touch(tmp, f"reelected.{i}")
        touch(tmp, f"counted.{i}")
        wait_for(tmp, "done.3")
        m.leave()
        return
    if offer:
        wait_for(tmp, "eof.1", "eof.2")  # both holders saw the server go and wait to bind
        rv._OFFER_GRACE_S = 30.0  # ends at the first OFFER
        bind = rv._try_bind

        def bind_first(addr):
            sock = bind(addr)
            if sock is not None:
                touch(tmp, "bound.3")
            return sock
        rv._try_bind = bind_first
    else:
        wait_for(tmp, "reelected.1", "reelected.2")
    m = join(name)
    assert m.peer_pid in pids(tmp, 1, 2), (m, pids(tmp, 1, 2))
    touch(tmp, "joined.3")
    if offer:
        say(f"holders {wait_until(lambda: m.holders() == 3 and 3, 'the newcomer serves both holders')}")
    wait_for(tmp, "counted.1", "counted.2")
    touch(tmp, "done.3")
    m.leave()


def scenario_offer(i, n, tmp, name):
    scenario_kill_server(i, n, tmp, name, offer=True)


def three_holders(i, tmp, name):
    """Worker 0 packs and publishes, then workers 1 and 2 attach; returns once all three hold it."""
    if i == 0:
        m = join(name)
        touch(tmp, "published.0")
    else:
        wait_for(tmp, "published.0")
        m = join(name)
    touch(tmp, f"attached.{i}")
    wait_for(tmp, "attached.0", "attached.1", "attached.2")
    return m


def scenario_holders(i, n, tmp, name):
    """Three holders count 3; after a holder leaves, 2; after the server leaves, the
    last one serves itself and counts 1."""
    m = three_holders(i, tmp, name)
    say(f"holders {wait_until(lambda: m.holders() == 3 and 3, 'three holders')}")
    if i == 1:  # a second membership in one process: still three processes
        second = rv.join(name, validate=validator(name))
        assert second.role == "attached" and second.value.inode == m.arena.inode, second
        say(f"same-process {second.holders()} {m.holders()}")
        os.close(second.value.fd)
        second.leave()
    touch(tmp, f"counted.{i}")
    wait_for(tmp, "counted.0", "counted.1", "counted.2")
    if i == 2:
        m.leave()
        m.leave()  # idempotent
        assert m.holders() is None
        say("left")
        touch(tmp, "left.2")
        return
    wait_for(tmp, "left.2")
    say(f"holders {wait_until(lambda: m.holders() == 2 and 2, 'two holders')}")
    touch(tmp, f"counted2.{i}")
    wait_for(tmp, "counted2.0", "counted2.1")
    if i == 0:
        m.leave()
        say("left")
        touch(tmp, "left.0")
        return
    wait_for(tmp, "left.0")
    say(f"holders {wait_until(lambda: m.holders() == 1 and 1, 'one holder, serving itself')}")
    m.leave()


def scenario_kill_holder(i, n, tmp, name):
    """Worker 2, a holder, is SIGKILLed at "holding": the others count 2."""
    m = three_holders(i, tmp, name)
    wait_until(lambda: m.holders() == 3, "three holders")
    touch(tmp, f"counted.{i}")
    wait_for(tmp, "counted.0", "counted.1", "counted.2")
    if i == 2:
        say("holding")
        time.sleep(60)
        return
    say(f"holders {wait_until(lambda: m.holders() == 2 and 2, 'two holders after the kill')}")
    touch(tmp, f"counted2.{i}")
    wait_for(tmp, "counted2.0", "counted2.1")
    m.leave()


def scenario_abandon(i, n, tmp, name):
    """The packer abandons while worker 1 waits on it: worker 1 packs."""
    if i == 0:
        m = rv.join(name, validate=validator(name))
        assert m.role == "packer", m
        touch(tmp, "elected.0")
        wait_until(lambda: len(m._state.conns) == 1, "worker 1 waiting")
        m.abandon()
        say("abandoned")
        try:
            m.publish(make_arena(name))
        except rv.RendezvousError as e:
            say(f"publish refused: {e}")
        else:
            raise AssertionError("publish after abandon")
        wait_for(tmp, "done.1")
        return
    wait_for(tmp, "elected.0")
    join(name).leave()
    touch(tmp, "done.1")


def scenario_fork(i, n, tmp, name):
    """Worker 0 packs, forks a child that lives on, then leaves; worker 1 then finds
    no server and packs (a child that kept the inherited listener would leave the
    name bound with nobody accepting: worker 1 would wait out wait_s)."""
    if i == 0:
        m = join(name)
        pid = os.fork()
        if pid == 0:  # the child: no server, no holder; the rendezvous still works for it
            try:
                assert m.holders() is None, m
                other = rv.join(name + "-child", validate=validator(name + "-child"))
                assert other.role == "packer", other
                other.publish(make_arena(name + "-child"))
                other.leave()
                say("child ok")
                touch(tmp, "child")
                wait_for(tmp, "done.1")
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        wait_for(tmp, "child", timeout=30)
        m.leave()
        say("left")
        touch(tmp, "left.0")
        wait_for(tmp, "done.1")
        assert os.waitpid(pid, 0)[1] == 0, "the forked child failed"
        return
    wait_for(tmp, "left.0")
    m = join(name, wait_s=5.0)
    assert m.role == "packer", m
    m.leave()
    touch(tmp, "done.1")


def scenario_validate_raises(i, n, tmp, name):
    """validate raising: join raises that error, keeps no fd, and the server's count
    goes back to 1; a second join attaches."""
    if i == 0:
        m = join(name)
        touch(tmp, "published.0")
        wait_for(tmp, "refused.1")
        say(f"holders {wait_until(lambda: m.holders() == 1 and 1, 'the refused joiner gone')}")
        touch(tmp, "counted.0")
        wait_for(tmp, "done.1")
        m.leave()
        return
    wait_for(tmp, "published.0")

    def refuse(fd):
        raise ValueError(f"refused fd {fd} on purpose")
    try:
        rv.join(name, validate=refuse)
    except ValueError as e:
        say(f"raised {type(e).__name__}: {e}")
    else:
        raise AssertionError("join did not raise validate's error")
    assert memfds() == [], memfds()
    say("no fd left")
    touch(tmp, "refused.1")
    wait_for(tmp, "counted.0")
    join(name, wait_s=0).leave()  # a server that has the arena: wait_s=0 still attaches
    touch(tmp, "done.1")


def scenario_wait(i, n, tmp, name):
    """A packer that never publishes: past LAYERWISE_SHARE_WAIT_S the joiner is
    "private" and warns naming the packer's pid."""
    touch(tmp, f"pid.{i}")
    if i == 0:
        m = rv.join(name, validate=validator(name))
        assert m.role == "packer", m
        touch(tmp, "elected.0")
        wait_for(tmp, "done.1")
        m.abandon()
        return
    wait_for(tmp, "elected.0")

    class Say(logging.Handler):
        def emit(self, record):
            say(f"{record.levelname.lower()} {record.getMessage()}")
    logging.getLogger("layerwise").addHandler(Say(logging.WARNING))
    os.environ["LAYERWISE_SHARE_WAIT_S"] = "1"
    m = rv.join(name, validate=validator(name))
    say(f"role {m.role}")
    assert m.role == "private" and m.value is None and m.holders() is None, m
    m.leave()
    touch(tmp, "done.1")


SCENARIOS = {k[len("scenario_"):]: v for k, v in globals().items() if k.startswith("scenario_")}

if __name__ == "__main__":
    index, n, tmp, scenario, name = sys.argv[1:6]
    index, n, tmp = int(index), int(n), Path(tmp)
    say(f"pid {os.getpid()}")
    SCENARIOS[scenario](index, n, tmp, name)
    say(f"rank {index} ok")
