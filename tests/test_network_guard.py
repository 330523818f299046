"""The conftest socket guard: the network is out of reach for every test, loopback is not."""

import socket
import urllib.request

import pytest
from conftest import NetworkBlocked

from capsnet.data import load_dataset


@pytest.mark.parametrize(
    "reach",
    [
        lambda: socket.create_connection(("example.com", 80), timeout=1),
        lambda: socket.getaddrinfo("pypi.org", 443),
        lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("93.184.216.34", 80)),
        lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).connect_ex(("2606:2800:220:1::", 80)),
        lambda: urllib.request.urlopen("http://example.com/", timeout=1),
    ],
)
def test_the_guard_blocks_the_network(reach, network_guard):
    with pytest.raises(NetworkBlocked, match="tests must not use the network"):
        reach()
    assert network_guard  # recorded: the fixture fails the test at teardown even if the error were swallowed
    network_guard.clear()


def test_the_guard_fires_through_capsnets_downloader(network_guard, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path))
    with pytest.raises(NetworkBlocked):  # not swallowed by the retries over mirrors
        load_dataset("kmnist", mirrors=["http://example.com/"])
    assert network_guard and "example.com" in network_guard[0]
    network_guard.clear()


def test_loopback_is_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("localhost", port), timeout=5):
            conn, _ = server.accept()
            conn.close()
