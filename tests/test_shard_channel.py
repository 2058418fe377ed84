"""The expert shard's socket (colibri_core/fleet/shardchannel.py) without Ray: a
ChannelServer in this process, the driver's Channel to it over the Unix socket and TCP.
Results bit for bit what the compute returned; a refusal raised with the shard's words
and the channel still usable; a server that closes mid-request, or answers nothing, is
ChannelClosed; an answer later than the deadline is flagged slow; an answer the driver
never read is not taken for the next one."""
import threading

import numpy as np
import pytest

from colibri_core.fleet.shardchannel import Channel, ChannelClosed, ChannelServer, host_id


def _compute(layer, xn, experts, weights):
    if layer < 0:
        raise ValueError(f"layer {layer} is not a MoE layer")
    return xn * weights[:, None] + experts[:, None].astype(np.float32) * np.float32(layer)


def _pairs(rows, hidden=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, hidden)).astype(np.float32),
            rng.integers(0, 8, rows), rng.random(rows).astype(np.float32))


@pytest.fixture
def server():
    s = ChannelServer(_compute, "127.0.0.1")
    yield s
    s.close()


@pytest.mark.parametrize("transport,kind", [("auto", "unix"), ("tcp", "tcp")])
def test_channel_round_trip_bits(server, transport, kind):
    c = Channel(server.address, transport, timeout_s=30)
    assert c.kind == kind
    for rows, layer in ((1, 1), (7, 2), (300, 3)):      # 300 rows: 77 KB each way
        xn, e, w = _pairs(rows, seed=rows)
        out, slow = c.recv(c.send(layer, xn, e, w), deadline_s=30, timeout_s=30)
        want = _compute(layer, xn, e, w)
        assert out.dtype == np.float32 and np.array_equal(out.view(np.uint32), want.view(np.uint32))
        assert not slow
    c.close()


def test_channel_refusal_raises_and_stays_in_step(server):
    c = Channel(server.address, timeout_s=30)
    with pytest.raises(RuntimeError, match="layer -1 is not a MoE layer"):
        c.recv(c.send(-1, *_pairs(3)), 30, 30)
    xn, e, w = _pairs(3)
    out, _ = c.recv(c.send(2, xn, e, w), 30, 30)
    assert np.array_equal(out, _compute(2, xn, e, w))


def test_channel_unread_answer_is_not_the_next(server):
    c = Channel(server.address, timeout_s=30)
    c.send(1, *_pairs(5, seed=1))                        # a step that failed elsewhere
    xn, e, w = _pairs(5, seed=2)
    out, _ = c.recv(c.send(3, xn, e, w), 30, 30)
    assert np.array_equal(out, _compute(3, xn, e, w))


def test_channel_closed_mid_request_and_silence():
    got, go = {}, threading.Event()

    def compute(layer, xn, experts, weights):
        if layer == 1:                                   # dies with the request in it
            got["conn"].close()
            raise RuntimeError("gone")
        go.wait(30)                                      # answers nothing until told
        return xn

    s = ChannelServer(compute, "127.0.0.1")
    real = s._serve
    s._serve = lambda conn: (got.update(conn=conn), real(conn))
    try:
        c = Channel(s.address, timeout_s=30)
        with pytest.raises(ChannelClosed, match="its socket"):
            c.recv(c.send(1, *_pairs(2)), 30, 30)
        c = Channel(s.address, timeout_s=0.3)
        with pytest.raises(ChannelClosed, match="no answer within 0.3 s"):
            c.recv(c.send(2, *_pairs(2)), 0.1, 0.3)
        go.set()
        c = Channel(s.address, timeout_s=30)
        go.clear()
        h = c.send(2, *_pairs(2))
        threading.Timer(0.3, go.set).start()
        out, slow = c.recv(h, 0.05, 30)                  # later than the deadline
        assert slow and out.shape == (2, 64)
    finally:
        go.set()
        s.close()


def test_channel_tcp_when_another_host(server):
    c = Channel({**server.address, "host": host_id() + "-elsewhere"}, "auto", 30)
    assert c.kind == "tcp"
    with pytest.raises(ValueError, match="transport 'udp'"):
        Channel(server.address, "udp", 30)
    with pytest.raises(ChannelClosed, match="cannot connect"):
        server.close()
        Channel({**server.address, "host": "elsewhere"}, "auto", 30)
