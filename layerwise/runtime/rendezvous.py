"""rendezvous: how the processes of one machine that stream the same layer group
find each other, elect the one that packs the group's shared host arena, pass
the arena's sealed memfd to the others, and count who holds it.

One abstract AF_UNIX SOCK_SEQPACKET address per arena, `@layerwise/<euid>/<name>`.
An abstract name has no filesystem entry and vanishes with its last socket, so a
SIGKILL at any moment leaves nothing behind; the memfd itself is freed by the
kernel with its last fd or mapping.

- Election is the bind(): atomic in the kernel. The winner packs (role "packer")
  and publishes the sealed fd; a loser connects, checks the server's uid
  (SO_PEERCRED), and receives PACKING (it waits) or READY with the fd (SCM_RIGHTS).
- The server keeps every accepted connection open, so the holders are its
  connections plus itself; the kernel closes a killed peer's socket, so the count
  needs no cleanup code.
- Holders keep their connection to the server open. When it closes (the server
  left or died), they elect again: the winner of the bind serves its own dup of
  the fd, the others connect to it. A newcomer that wins that bind first waits a
  short grace for an OFFER of the fd from a holder before it packs a second copy.
- One daemon thread per process ("layerwise-rendezvous") serves and watches all of
  the process's memberships. Sockets are close-on-exec, and a forked child closes
  every inherited rendezvous socket (os.register_at_fork): it neither serves nor
  leaves the name bound with nobody accepting.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
import weakref

log = logging.getLogger("layerwise")

PACKING = b"PACKING"   # server -> client: the arena is being packed; wait for READY or EOF
READY = b"READY"       # server -> client, with the sealed memfd
OFFER = b"OFFER"       # holder -> a server that is still in its grace, with the holder's memfd
COUNT = b"COUNT"       # client -> server; the answer is b"COUNT <holders>"

WAIT_ENV = "LAYERWISE_SHARE_WAIT_S"
DEFAULT_WAIT_S = 600.0

# How long a newly elected server waits for an OFFER from holders of an arena that
# already exists (they elect again when their server goes, and a newcomer may win
# the bind first). A holder offers within milliseconds of the EOF; a missed offer
# costs a second copy of the arena, never a wrong one.
_OFFER_GRACE_S = 0.2
# First pause between tries when the address is bound but not yet listening (a
# winner between its bind() and listen()); it doubles up to _RETRY_MAX_S.
_RETRY_S = 0.01
_RETRY_MAX_S = 0.5
# An address bound that long without accepting connections is not a layerwise
# server (a candidate listens right after its bind): refused, naming the address.
_DEAF_S = 5.0
_CONNECT_TIMEOUT_S = 5.0
# A server answers PACKING or READY as soon as its loop thread accepts; a joiner
# waits at least this long for that first answer, even with a smaller wait_s.
_ANSWER_S = 5.0
_COUNT_TIMEOUT_S = 2.0
_LOG_EVERY_S = 10.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RendezvousError(RuntimeError):
    """The rendezvous of a shared arena failed; the message names the address and the cause."""


def address(name: str) -> bytes:
    """The abstract socket address of the arena `name` for this effective uid."""
    if not name or not name.isascii() or not name.isprintable() or "/" in name:
        raise ValueError(f"a rendezvous name is printable ASCII without '/', got {name!r}")
    addr = f"\0layerwise/{os.geteuid()}/{name}".encode()
    if len(addr) > 107:  # sizeof(sun_path) - 1 for the leading NUL
        raise ValueError(f"rendezvous name {name!r} is too long ({len(addr)} > 107 bytes as an address)")
    return addr


def _show(addr: bytes) -> str:
    return "@" + addr[1:].decode()


# ---- per-process state; every field below is guarded by _lock ----------------------
_lock = threading.RLock()   # reentrant: a membership's finalizer may run in the loop thread
_loop: _Loop | None = None  # the daemon thread and its selector, started on first use
_states: set[_State] = set()           # memberships that serve, hold or pack
_sockets: set[socket.socket] = set()   # every rendezvous socket of this process (a forked child closes them)
_hooked = False                        # the at-fork and atexit hooks are installed (at the first join)


def _new_socket() -> socket.socket:
    with _lock:  # created and recorded under the lock, so a fork never misses one
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        _sockets.add(s)
        return s


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with _lock:
        if _loop is not None:
            _loop.unwatch(sock)
        _sockets.discard(sock)
        sock.close()


def _peercred(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and its fds (close-on-exec); (b"", []) at EOF or any error of the
    connection. Nothing to read yet raises (BlockingIOError, or TimeoutError)."""
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 4, socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError, TimeoutError):
        raise
    except OSError:
        return b"", []
    return msg, fds


def _close_fds(fds) -> None:
    for fd in fds:
        os.close(fd)


def _try_bind(addr: bytes) -> socket.socket | None:
    """A listening socket bound to `addr`, or None when another socket has it."""
    with _lock:
        s = _new_socket()
        try:
            s.bind(addr)
        except OSError as e:
            _close(s)
            if e.errno == errno.EADDRINUSE:
                return None
            raise RendezvousError(f"cannot bind the rendezvous address {_show(addr)}: {e}") from e
        s.listen(socket.SOMAXCONN)
        s.setblocking(False)
        return s


class _Peer:
    """A connection accepted by a server."""

    def __init__(self, pid: int):
        self.pid = pid         # SO_PEERCRED at connect()
        self.served = False    # READY and the fd were sent: a holder


class _State:
    """What the rendezvous keeps for one membership (the Membership's finalizer holds
    this, never the Membership, so dropping a Membership leaves)."""

    def __init__(self, name: str, addr: bytes, role: str):
        self.name = name
        self.addr = addr
        self.role = role
        # "grace" (elected, waiting for OFFERs), "packing", "serving", "holding",
        # "electing" (lost the server, binds or connects again), "alone" (the address
        # is taken by another uid), "private", "left", "forked"
        self.mode = "private"
        self.fd: int | None = None                  # our dup of the sealed memfd
        self.listener: socket.socket | None = None  # while grace, packing, serving
        self.conns: dict[socket.socket, _Peer] = {}  # accepted connections
        self.client: socket.socket | None = None    # our connection to the server, while holding
        self.offered = False                        # OFFER sent on self.client
        self.offers: list[tuple[int, int]] = []     # (fd, pid) offered during the grace
        self.reelect_at: float | None = None        # when to bind or connect again
        self.retry = _RETRY_S
        self.count: int | None = None               # the server's last COUNT answer
        self.count_gen = 0
        self.cond = threading.Condition(_lock)

    def leave(self) -> None:
        with _lock:
            if self.mode in ("private", "left", "forked"):
                return
            _close(self.listener)
            for conn in list(self.conns):
                _close(conn)
            _close(self.client)
            self.listener, self.client, self.conns = None, None, {}
            _close_fds(fd for fd, _ in self.offers)
            self.offers = []
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self.mode = "left"
            self.reelect_at = None
            _states.discard(self)
            self.cond.notify_all()

    # -- server side (called by the loop thread, under _lock) ------------------------
    def holders(self) -> int:
        return len({os.getpid()} | {p.pid for p in self.conns.values() if p.served})

    def listen(self, listener: socket.socket, mode: str) -> None:
        self.listener, self.mode = listener, mode
        _states.add(self)
        _get_loop().watch(listener, self.on_accept)

    def on_accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        conn.setblocking(False)
        pid, uid = _peercred(conn)
        # another user's process (it learns nothing), or this membership left meanwhile
        if uid != os.geteuid() or self.listener is not listener:
            conn.close()
            return
        _sockets.add(conn)
        self.conns[conn] = _Peer(pid)
        _get_loop().watch(conn, self.on_conn)
        if self.mode == "serving":
            self.send_ready(conn)
        else:
            self.send(conn, PACKING)

    def on_conn(self, conn: socket.socket) -> None:
        try:
            msg, fds = _recv(conn)
        except (BlockingIOError, InterruptedError):
            return
        peer = self.conns.get(conn)
        if not msg or peer is None:
            _close_fds(fds)
            self.drop(conn)
            return
        if msg == COUNT:
            self.send(conn, b"COUNT %d" % self.holders())
        elif msg == OFFER and fds and self.mode == "grace":
            self.offers.append((fds.pop(0), peer.pid))
            self.cond.notify_all()
        _close_fds(fds)

    def send(self, conn: socket.socket, msg: bytes, fds=()) -> bool:
        try:
            socket.send_fds(conn, [msg], list(fds)) if fds else conn.send(msg)
        except OSError:  # gone, or not reading at all: it no longer counts
            self.drop(conn)
            return False
        return True

    def send_ready(self, conn: socket.socket) -> None:
        if self.send(conn, READY, [self.fd]):
            self.conns[conn].served = True

    def serve(self, fd: int) -> None:
        self.fd, self.mode = fd, "serving"
        for conn, peer in list(self.conns.items()):
            if not peer.served:
                self.send_ready(conn)

    def drop(self, conn: socket.socket) -> None:
        self.conns.pop(conn, None)
        _close(conn)

    # -- holder side (loop thread, under _lock) -------------------------------------
    def hold(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.client, self.mode, self.offered = sock, "holding", False
        self.retry = _RETRY_S
        _states.add(self)
        _get_loop().watch(sock, self.on_server)

    def on_server(self, sock: socket.socket) -> None:
        try:
            msg, fds = _recv(sock)
        except (BlockingIOError, InterruptedError):
            return
        _close_fds(fds)  # a READY from a server elected after ours went: we keep our own fd
        if not msg:
            _close(sock)
            self.client, self.mode, self.reelect_at = None, "electing", time.monotonic()
            self.cond.notify_all()
            return
        if msg == PACKING and not self.offered:
            # A fresh candidate: give it our arena, so that it does not pack a second one.
            self.offered = True
            try:
                socket.send_fds(sock, [OFFER], [self.fd])
            except OSError:
                pass  # its EOF follows
        elif msg.startswith(COUNT + b" "):
            self.count, self.count_gen = int(msg.split()[1]), self.count_gen + 1
            self.cond.notify_all()

    def elect(self) -> None:
        """The server went: serve our own fd, or hold from whoever won the bind."""
        listener = _try_bind(self.addr)
        if listener is not None:
            self.reelect_at = None
            self.listen(listener, "serving")
            log.debug("layerwise: %s: serving the arena again (pid %d)", _show(self.addr), os.getpid())
            return
        sock = _new_socket()
        sock.setblocking(False)
        try:
            sock.connect(self.addr)
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError, InterruptedError):
            # bound but not listening yet (a winner between bind and listen), or a full backlog
            _close(sock)
            self.reelect_at = time.monotonic() + self.retry
            self.retry = min(2 * self.retry, _RETRY_MAX_S)
            return
        pid, uid = _peercred(sock)
        if uid != os.geteuid():
            _close(sock)
            self.mode, self.reelect_at = "alone", None
            log.warning("layerwise: %s is bound by uid %d (pid %d): this process keeps its shared arena "
                        "but can no longer share it; stop that process to share again", _show(self.addr), uid, pid)
            return
        self.reelect_at = None
        self.hold(sock)


class _Loop:
    """The daemon thread that serves and watches every membership of this process.
    Handlers run under _lock and never block (non-blocking sockets); other threads
    register and unregister sockets under _lock while it waits in epoll_wait, which
    the kernel allows (a handler tolerates a wakeup for a socket already handled)."""

    def __init__(self):
        self.selector = selectors.EpollSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        for s in (self.wake_r, self.wake_w):
            s.setblocking(False)
            _sockets.add(s)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.closed = False
        self.thread = threading.Thread(target=self.run, name="layerwise-rendezvous", daemon=True)
        self.thread.start()

    def watch(self, sock: socket.socket, handler) -> None:
        self.selector.register(sock, selectors.EVENT_READ, handler)
        self.wake()

    def unwatch(self, sock: socket.socket) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def wake(self) -> None:
        if threading.current_thread() is not self.thread:
            try:
                self.wake_w.send(b"w")
            except OSError:
                pass  # already awake (a full buffer) or shut down

    def run(self) -> None:
        while True:
            with _lock:
                if self.closed:
                    return
                due = [s.reelect_at for s in _states if s.reelect_at is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
            try:
                events = self.selector.select(timeout)
            except (OSError, ValueError):  # the selector was closed at shutdown
                return
            with _lock:
                if self.closed:
                    return
                for key, _ in events:
                    if key.fileobj.fileno() < 0:  # closed after epoll reported it
                        continue
                    try:
                        if key.data is None:
                            while self.wake_r.recv(4096):
                                pass
                        else:
                            key.data(key.fileobj)
                    except (BlockingIOError, InterruptedError):
                        pass
                    except Exception:  # a bug: drop the socket rather than fail on it at every wakeup
                        log.exception("layerwise: rendezvous: a handler failed; closing its socket")
                        _close(key.fileobj)
                now = time.monotonic()
                for s in list(_states):
                    if s.reelect_at is not None and s.reelect_at <= now and s.mode == "electing":
                        try:
                            s.elect()
                        except Exception:
                            log.exception("layerwise: rendezvous: electing %s failed", _show(s.addr))
                            s.reelect_at = now + _RETRY_MAX_S

    def close(self) -> None:
        with _lock:
            self.closed = True
            self.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=2.0)
        with _lock:
            for s in (self.wake_r, self.wake_w):
                _sockets.discard(s)
                s.close()
            if not self.thread.is_alive():
                self.selector.close()


def _get_loop() -> _Loop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = _Loop()
        return _loop


class Membership:
    """This process's part in the rendezvous of one shared arena.

    role: "packer" (pack, then publish() or abandon()), "attached" (`value` is
    what validate returned for the received fd) or "private" (no arena arrived
    within wait_s: pack a private copy, nothing is shared).
    """

    def __init__(self, state: _State, value: object = None, peer_pid: int | None = None):
        self.role: str = state.role                   # fixed at join
        self.value: object = value                    # validate's value (attached)
        self.peer_pid: int | None = peer_pid          # the process that sent the fd (attached)
        self._state = state
        self._finalizer = weakref.finalize(self, state.leave)
        self._finalizer.atexit = False  # _shutdown leaves every membership at exit

    @property
    def name(self) -> str:
        return self._state.name

    def publish(self, fd: int) -> None:
        """The arena is complete and sealed: keep a dup of `fd` and send it to every
        waiter and every later joiner. The caller keeps `fd`."""
        with _lock:
            s = self._state
            if s.role != "packer" or s.mode != "packing":
                raise RendezvousError(f"publish() on {_show(s.addr)}: this membership is {s.role} and {s.mode}; "
                                      f"only a packer that has neither published, abandoned nor left publishes")
            s.serve(os.dup(fd))

    def abandon(self) -> None:
        """Packing failed: drop the election; the waiters see EOF and one of them packs."""
        with _lock:
            s = self._state
            if s.role != "packer" or s.mode not in ("packing", "left", "forked"):
                raise RendezvousError(f"abandon() on {_show(s.addr)}: this membership is {s.role} and {s.mode}; "
                                      f"only a packer that has not published abandons (leave() detaches)")
            s.leave()

    def holders(self) -> int | None:
        """The processes that hold the arena now, this one included (best effort:
        None while the holders elect a new server, or when unknown)."""
        with _lock:
            s = self._state
            if s.mode in ("packing", "serving"):
                return s.holders()
            if s.mode != "holding" or s.client is None:
                return None
            gen = s.count_gen
            try:
                s.client.send(COUNT)
            except OSError:
                return None
            end = time.monotonic() + _COUNT_TIMEOUT_S
            while s.count_gen == gen and s.mode == "holding":
                left = end - time.monotonic()
                if left <= 0 or not s.cond.wait(left):
                    break
            return s.count if s.count_gen != gen else None

    def leave(self) -> None:
        """Detach (idempotent): a server's holders elect a new one; the kept fd dup is closed."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"Membership({_show(self._state.addr)}, role={self.role!r}, mode={self._state.mode!r}, "
                f"peer_pid={self.peer_pid})")


def _wait_s_default() -> float:
    raw = os.environ.get(WAIT_ENV)
    if not raw:
        return DEFAULT_WAIT_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from None


def _validated(fd: int, validate):
    """validate(fd) -> value, with our own dup kept for serving later; on an error
    fd is closed (unless validate already closed it) and the error propagates."""
    keep = os.dup(fd)
    try:
        return keep, validate(fd)
    except BaseException:
        kept = os.fstat(keep)
        try:
            same = os.path.samestat(os.fstat(fd), kept)
        except OSError:
            same = False  # validate closed it already
        if same:
            os.close(fd)
        os.close(keep)
        raise


def _attach(name: str, addr: bytes, sock: socket.socket, validate, deadline: float, wait_s: float):
    """Connected to the server of `addr`: a Membership, or None when the server went
    before it sent the fd (elect again)."""
    pid, uid = _peercred(sock)
    if uid != os.geteuid():
        _close(sock)
        raise RendezvousError(f"{_show(addr)} is bound by uid {uid} (pid {pid}), not by this user "
                              f"(uid {os.geteuid()}): the shared arena cannot be trusted; stop that process, "
                              f"or share under its user")
    start = time.monotonic()
    next_log = start + _LOG_EVERY_S
    answered = False  # wait_s bounds the wait for a packer; any server gets _ANSWER_S to say which it is
    while True:
        now = time.monotonic()
        limit = deadline if answered else max(deadline, start + _ANSWER_S)
        if now >= limit:
            _close(sock)
            what = "is still packing the shared arena" if answered else "accepted but never answered"
            log.warning("layerwise: %s: pid %d %s after %.1f s (%s=%g); this process packs a private copy. "
                        "Set %s higher to wait longer", _show(addr), pid, what, now - (deadline - wait_s), WAIT_ENV,
                        wait_s, WAIT_ENV)
            return Membership(_State(name, addr, "private"))
        sock.settimeout(max(0.001, min(limit, next_log) - now))
        try:
            msg, fds = _recv(sock)
        except TimeoutError:
            if time.monotonic() >= next_log:
                log.info("layerwise: %s: waiting for pid %d to pack the shared arena", _show(addr), pid)
                next_log += _LOG_EVERY_S
            continue
        if not msg:
            _close_fds(fds)
            _close(sock)
            return None
        answered = True
        if msg == READY and fds:
            fd = fds.pop(0)
            _close_fds(fds)
            try:
                keep, value = _validated(fd, validate)
            except BaseException:
                _close(sock)
                raise
            state = _State(name, addr, "attached")
            with _lock:
                state.fd = keep
                state.hold(sock)
            return Membership(state, value, pid)
        _close_fds(fds)  # PACKING: wait on


def _packer_or_offer(name: str, addr: bytes, listener: socket.socket, validate) -> Membership:
    """Won the bind: wait the grace for an OFFER from holders of an existing arena,
    serve it if one comes, else this process packs."""
    state = _State(name, addr, "packer")
    try:
        with _lock:
            state.listen(listener, "grace")
            end = time.monotonic() + _OFFER_GRACE_S
            while not state.offers and (left := end - time.monotonic()) > 0:
                state.cond.wait(left)
            offers, state.offers = state.offers, []
            if not offers:
                state.mode = "packing"
                return Membership(state)
            state.mode = "offered"  # OFFERs that still arrive are closed
    except BaseException:  # an interrupt in the grace: the waiters see EOF and elect again
        state.leave()
        raise
    (fd, pid), rest = offers[0], offers[1:]
    _close_fds(f for f, _ in rest)
    try:
        keep, value = _validated(fd, validate)
    except BaseException:
        state.leave()
        raise
    with _lock:
        state.role = "attached"
        if state.mode == "offered":
            state.serve(keep)
        else:  # forked meanwhile
            os.close(keep)
    return Membership(state, value, pid)


def join(name: str, *, validate, wait_s: float | None = None) -> Membership:
    """Join the rendezvous of the arena `name` (see the module docstring).

    Args:
        name: the arena's name (the share key's 32 hex characters).
        validate: validate(fd) -> value, called on a received memfd before it is
            trusted; what it returns is `Membership.value` (and owns fd). If it raises,
            fd is closed and the error propagates.
        wait_s: how long to wait for a packer that is still packing (default: env
            LAYERWISE_SHARE_WAIT_S, else 600 s); past it the role is "private" and
            a warning names the packer's pid.
    """
    addr = address(name)
    if wait_s is None:
        wait_s = _wait_s_default()
    _hook_process()
    deadline = time.monotonic() + wait_s
    deaf_since = None
    retry = _RETRY_S
    while True:
        sock = _new_socket()
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            sock.connect(addr)
        except (ConnectionRefusedError, FileNotFoundError):
            _close(sock)
            listener = _try_bind(addr)
            if listener is not None:
                return _packer_or_offer(name, addr, listener, validate)
            # Bound but not listening: a winner between its bind() and listen(), or not layerwise.
            now = time.monotonic()
            deaf_since = deaf_since or now
            if now - deaf_since > _DEAF_S:
                raise RendezvousError(f"{_show(addr)} has been bound for {_DEAF_S:g} s by a socket that accepts no "
                                      f"connection: not a layerwise server (maybe another user's process); find it "
                                      f"with `ss -xlp | grep layerwise` and stop it") from None
            time.sleep(retry)
            retry = min(2 * retry, _RETRY_MAX_S)
            continue
        except (TimeoutError, BlockingIOError):  # a full backlog: try again
            _close(sock)
            if time.monotonic() >= deadline:
                log.warning("layerwise: %s: no connection accepted within %g s (%s); this process packs a "
                            "private copy", _show(addr), wait_s, WAIT_ENV)
                return Membership(_State(name, addr, "private"))
            continue
        except BaseException:
            _close(sock)
            raise
        deaf_since, retry = None, _RETRY_S
        try:
            member = _attach(name, addr, sock, validate, deadline, wait_s)
        except BaseException:
            _close(sock)
            raise
        if member is not None:
            return member


def _before_fork() -> None:
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    # The child has no loop thread: it must neither keep the name bound with nobody
    # accepting (newcomers would hang in recv) nor keep connections that count it
    # as a holder. Close our copies of the fds only; unregistering from the epoll
    # instance (shared with the parent) would unregister the parent's sockets.
    global _lock, _loop
    for s in _states:
        if s.fd is not None:
            os.close(s.fd)
        _close_fds(fd for fd, _ in s.offers)
        s.fd, s.listener, s.client, s.conns, s.offers = None, None, None, {}, []
        s.mode, s.reelect_at = "forked", None
    for sock in _sockets:
        sock.close()
    if _loop is not None:
        _loop.closed = True
        _loop.selector.close()
    _states.clear()
    _sockets.clear()
    _loop = None
    _lock = threading.RLock()


def _shutdown() -> None:
    global _loop
    with _lock:
        for s in list(_states):
            s.leave()
        loop, _loop = _loop, None
    if loop is not None:
        loop.close()


def _hook_process() -> None:
    """Install the at-fork and atexit hooks once, at the first join: a process that
    never shares an arena gets neither."""
    global _hooked
    with _lock:
        if not _hooked:
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
            atexit.register(_shutdown)
            _hooked = True
