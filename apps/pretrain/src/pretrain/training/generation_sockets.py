"""The TCP connections of one generation's process groups, shut down when a survivor leaves that generation.

A gloo group's connections close only once nothing holds the group: destroying or aborting it leaves them
open, and a survivor's previous trainer, which it copies its state from, holds its groups until the next
generation's trainer is built. A survivor still blocked on this rank in one of the left generation's
collectives would then wait out the collective's timeout while this rank waits for it in the next
generation's rendezvous, and whichever timeout fires first decides whether the run goes on. So each
generation's connections are noted as its groups are built (the sockets this process opened meanwhile),
and a survivor that leaves the generation after a loss shuts them down: the late survivor's collective
fails at once ("Connection closed by peer") and it regroups too. The store's connection is kept.
"""

from __future__ import annotations

import os
import socket

_FDS = "/proc/self/fd"


def _socket_fds() -> list[tuple[int, int]]:
    """(descriptor, socket inode) of every socket this process holds (empty where ``/proc`` is not there)."""
    found = []
    try:
        fds = os.listdir(_FDS)
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"{_FDS}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found.append((int(fd), int(link[len("socket:["):-1])))
    return found


def open_sockets() -> set[int]:
    """The inodes of this process's sockets (empty where ``/proc`` is not there: nothing is shut down)."""
    return {inode for _, inode in _socket_fds()}


def shut_down(inodes: set[int], store_port: int) -> int:
    """Shut down every connected TCP socket of ``inodes`` but the store's (its peer's port ``store_port``):
    both directions, so each peer reads the end of the stream. Listening sockets stay; the descriptors stay
    open (their groups close them when they go). Returns how many were shut down."""
    done = 0
    for fd, inode in _socket_fds():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                    and sock.getpeername()[1] != store_port:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:  # not connected (a listener), or already shut down
            pass
        finally:
            sock.close()  # the duplicate only
    return done
