"""The rendezvous of a shared host arena (layerwise/runtime/rendezvous.py): processes
elect one packer, receive its sealed memfd, count holders, and recover from a
SIGKILL at any point. The checks run in fresh interpreters
(tests/helpers/share_worker.py, with a small memfd as the arena); each test uses
its own name, so parallel runs never meet, and checks that once every process has
exited no socket and no memfd of that name is left."""
import glob
import os
import subprocess
import sys
import uuid

import pytest

from layerwise.runtime import rendezvous

from helpers.ranks import run_sharers


def fresh_name():
    return uuid.uuid4().hex


def facts(lines, word):
    """The values of the lines `word VALUE` of one worker's output."""
    return [line.split(" ", 1)[1] for line in lines if line.startswith(word + " ")]


def the(lines, word):
    values = facts(lines, word)
    assert len(values) == 1, (word, lines)
    return values[0]


def assert_nothing_left(name):
    shown = rendezvous.address(name)[1:].decode()
    with open("/proc/net/unix") as f:
        sockets = [line for line in f if shown in line]
    assert not sockets, sockets
    maps = []
    for path in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(path) as f:
                maps += [f"{path}: {line}" for line in f if f"memfd:layerwise-test:{name}" in line]
        except OSError:
            pass  # a process that exited meanwhile
    assert not maps, maps
    fds = []
    for path in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if f"memfd:layerwise-test:{name}" in os.readlink(path):
                fds.append(path)
        except OSError:
            pass
    assert not fds, fds


def test_address_names_the_user_and_the_arena():
    name = fresh_name()
    assert rendezvous.address(name) == f"\0layerwise/{os.geteuid()}/{name}".encode()
    for bad in ("", "a/b", "a\nb", "é", "x" * 100):
        with pytest.raises(ValueError, match="rendezvous name"):
            rendezvous.address(bad)


def test_four_processes_joining_at_once_elect_one_packer_and_share_its_memfd(tmp_path):
    name = fresh_name()
    out = run_sharers(4, tmp_path, "together", name)
    roles = [the(lines, "role") for lines in out]
    assert sorted(roles) == ["attached"] * 3 + ["packer"], roles
    assert len({the(lines, "inode") for lines in out}) == 1, out
    packer = the(out[roles.index("packer")], "pid")
    assert all(the(lines, "peer") == packer for lines, role in zip(out, roles) if role == "attached"), out
    assert_nothing_left(name)


def test_sigkill_of_the_packer_while_packing_elects_one_new_packer(tmp_path):
    name = fresh_name()
    out = run_sharers(4, tmp_path, "kill_packing", name, kill=(0, "packing"))
    roles = [the(lines, "role") for lines in out[1:]]
    assert sorted(roles) == ["attached", "attached", "packer"], roles
    assert len({the(lines, "inode") for lines in out[1:]}) == 1, out
    assert_nothing_left(name)


def test_sigkill_of_the_server_after_publish_a_holder_serves_a_newcomer_the_same_memfd(tmp_path):
    name = fresh_name()
    out = run_sharers(4, tmp_path, "kill_server", name, kill=(0, "serving"))
    assert [the(lines, "role") for lines in out] == ["packer", "attached", "attached", "attached"], out
    assert len({the(lines, "inode") for lines in out}) == 1, out  # worker 3 came after worker 0 died
    assert the(out[3], "peer") in {the(out[1], "pid"), the(out[2], "pid")}, out
    assert facts(out[1], "holders") == facts(out[2], "holders") == ["2"], out
    assert_nothing_left(name)


def test_a_newcomer_that_wins_the_bind_before_the_holders_takes_their_offer(tmp_path):
    """The holders of a dead server bind again only after a newcomer won the bind:
    the newcomer serves a holder's OFFER instead of packing a second copy."""
    name = fresh_name()
    out = run_sharers(4, tmp_path, "offer", name, kill=(0, "serving"))
    assert the(out[3], "role") == "attached", out[3]
    assert len({the(lines, "inode") for lines in out}) == 1, out
    assert the(out[3], "peer") in {the(out[1], "pid"), the(out[2], "pid")}, out
    assert facts(out[3], "holders") == facts(out[1], "holders") == facts(out[2], "holders") == ["3"], out
    assert_nothing_left(name)


def test_holders_counts_the_processes_holding_the_arena(tmp_path):
    """3 holders count 3 everywhere; a holder leaves: 2; the server leaves: the last
    holder serves itself and counts 1."""
    name = fresh_name()
    out = run_sharers(3, tmp_path, "holders", name)
    assert facts(out[0], "holders") == ["3", "2"], out[0]
    assert facts(out[1], "holders") == ["3", "2", "1"], out[1]
    assert the(out[1], "same-process") == "3 3", out[1]  # two memberships of one process count once
    assert facts(out[2], "holders") == ["3"] and "left" in out[2], out[2]
    assert_nothing_left(name)


def test_a_sigkilled_holder_is_no_longer_counted(tmp_path):
    name = fresh_name()
    out = run_sharers(3, tmp_path, "kill_holder", name, kill=(2, "holding"))
    assert facts(out[0], "holders") == facts(out[1], "holders") == ["2"], out
    assert_nothing_left(name)


def test_abandon_lets_a_waiter_pack(tmp_path):
    name = fresh_name()
    out = run_sharers(2, tmp_path, "abandon", name)
    assert "abandoned" in out[0] and the(out[1], "role") == "packer", out
    assert f"@layerwise/{os.geteuid()}/{name}" in the(out[0], "publish"), out[0]
    assert_nothing_left(name)


def test_a_forked_child_neither_serves_nor_leaves_a_newcomer_hanging(tmp_path):
    """A packer forks, then leaves while its child lives on: a newcomer finds no
    server and packs (within wait_s=5, never "private"), and the child can still
    use the rendezvous for an arena of its own."""
    name = fresh_name()
    out = run_sharers(2, tmp_path, "fork", name)
    assert "child ok" in out[0] and the(out[1], "role") == "packer", out
    assert_nothing_left(name)
    assert_nothing_left(name + "-child")


def test_validate_raising_makes_join_raise_that_error_and_keep_nothing(tmp_path):
    name = fresh_name()
    out = run_sharers(2, tmp_path, "validate_raises", name)
    raised = the(out[1], "raised")
    assert raised.startswith("ValueError: refused fd ") and raised.endswith(" on purpose"), out[1]
    assert "no fd left" in out[1] and the(out[1], "role") == "attached", out[1]
    assert facts(out[0], "holders") == ["1"], out[0]  # the refused joiner no longer counts
    assert_nothing_left(name)


def test_a_packer_that_never_publishes_leaves_the_joiner_private_past_wait_s(tmp_path):
    name = fresh_name()
    out = run_sharers(2, tmp_path, "wait", name)
    assert the(out[1], "role") == "private", out[1]
    warning = the(out[1], "warning")
    assert f"pid {the(out[0], 'pid')}" in warning and f"@layerwise/{os.geteuid()}/{name}" in warning, warning
    assert "LAYERWISE_SHARE_WAIT_S" in warning, warning
    assert_nothing_left(name)


SQUATTER = """
import os, socket, sys
os.setuid(65534)
mode, addr = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if mode == "connect":
    s.connect(addr)
    print("received", s.recv(64), flush=True)
else:
    s.bind(addr)
    if mode == "listen":
        s.listen()
    print("bound", flush=True)
    sys.stdin.read()
"""


def squatter(mode, name):
    p = subprocess.Popen([sys.executable, "-c", SQUATTER, mode, rendezvous.address(name).hex()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() in ("bound", "received b''"), (line, p.stderr.read() if p.poll() is not None else "")
    return p, line.strip()


def never_called(fd):
    raise AssertionError("validate called on a squatter's fd")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a squatter as another user (CI runs as root)")
def test_another_users_squatter_is_refused_naming_the_address(monkeypatch):
    name = fresh_name()
    shown = f"@layerwise/0/{name}"
    p, _ = squatter("listen", name)
    try:
        with pytest.raises(rendezvous.RendezvousError) as e:
            rendezvous.join(name, validate=never_called)
        assert shown in str(e.value) and "uid 65534" in str(e.value) and f"pid {p.pid}" in str(e.value), e.value
    finally:
        p.communicate()
    # Bound without listening (no layerwise server does that past its bind): refused too.
    monkeypatch.setattr(rendezvous, "_DEAF_S", 0.3)
    p, _ = squatter("deaf", name)
    try:
        with pytest.raises(rendezvous.RendezvousError, match="accepts no connection") as e:
            rendezvous.join(name, validate=never_called)
        assert shown in str(e.value), e.value
    finally:
        p.communicate()
    # And a server closes another user's connection without a word, and does not count it.
    m = rendezvous.join(name, validate=never_called, wait_s=1)
    try:
        assert m.role == "packer"
        p, line = squatter("connect", name)
        p.communicate()
        assert line == "received b''" and m.holders() == 1
    finally:
        m.leave()
    assert_nothing_left(name)
