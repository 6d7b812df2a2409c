"""group_links.py: the sockets a group opened are found by inode and cut, waking a
thread blocked on one, while sockets opened before (a listener, another
connection) are left alone."""

from __future__ import annotations

import socket
import threading
import time

from ctxpar.parallel import group_links


def test_cut_wakes_a_blocked_receive_and_spares_other_sockets():
    listener = socket.create_server(("127.0.0.1", 0))
    kept = socket.create_connection(listener.getsockname())
    kept_peer, _ = listener.accept()
    before = group_links.socket_inodes()
    link = socket.create_connection(listener.getsockname())  # "the group's" connection
    link_peer, _ = listener.accept()
    opened = group_links.socket_inodes() - before
    assert len(opened) == 2  # both ends of the new connection are this process's

    received: list[bytes] = []
    waiter = threading.Thread(target=lambda: received.append(link.recv(1)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # blocked: nothing was sent
    assert group_links.cut(opened) == 2
    waiter.join(timeout=5)
    assert not waiter.is_alive() and received == [b""]  # woken as if the peer had closed

    kept.sendall(b"x")  # the connection opened before still works, and so does the listener
    assert kept_peer.recv(1) == b"x"
    again = socket.create_connection(listener.getsockname())
    for s in (listener, kept, kept_peer, link, link_peer, again):
        s.close()


def test_cut_skips_what_is_not_an_open_tcp_connection():
    before = group_links.socket_inodes()
    a, b = socket.socketpair()  # AF_UNIX: not a TCP link
    c = socket.create_server(("127.0.0.1", 0))  # a listener: nothing to cut
    opened = group_links.socket_inodes() - before
    c.close()
    assert group_links.cut(opened) == 0
    a.sendall(b"y")
    assert b.recv(1) == b"y"
    a.close()
    b.close()
