import ipaddress
import os
import socket

import pytest
import torch

# Under pytest-xdist (`make test` runs a worker per core) each worker computes on one thread: the workers share the
# cores, and a worker's subprocesses (OMP_NUM_THREADS) inherit the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))
if not torch.cuda.is_available():
    # Triton kernels run on the CPU under Triton's interpreter (tests/test_routing_triton.py). Triton reads this when
    # it is imported (by torch._dynamo, on capsnet's import), so it is set here, before any test module imports.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test`: --dist loadscope) a test module's tests go to one worker, so that its module
# fixtures are built once; the tests of the modules in SPREAD (long tests, cheap fixtures) each go where there is room,
# and those of the modules in BY_PARAM go by their parameters' id (test_export.py: a model's ONNX and .pt2 tests share
# its traced program, and each model goes where there is room).
SPREAD = {"test_trainability.py", "test_input_contract.py", "test_shipped.py"}
BY_PARAM = {"test_export.py"}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SpreadScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.rsplit("/", 1)[-1] in SPREAD:
                return nodeid  # a scope of its own
            if module.rsplit("/", 1)[-1] in BY_PARAM and nodeid.endswith("]"):
                return module + "[" + nodeid.split("[", 1)[1]  # the module's tests of these parameters
            return super()._split_scope(nodeid)

    return SpreadScheduling(config, log)


# The suite routes on the PyTorch path whatever the kernel cache holds; the kernel tests unset this and build the
# kernels explicitly (the `routing_kernel` fixture; tests/test_routing_cpu.py, tests/test_inverted_attention_cpu.py),
# as does tests/test_trainability.py for inverted-attention-capsnet.
# Subprocesses inherit it. CAPSNET_NO_EXT=0 in the environment runs the whole suite with the kernels it finds built.
os.environ.setdefault("CAPSNET_NO_EXT", "1")

# Tests never touch the network: a connection (or a name lookup) for any host but this machine's loopback raises
# NetworkBlocked, and the test fails even if the code under test swallows the error. Loopback stays allowed:
# test_download serves a fake mirror on 127.0.0.1, torchrun's gloo rendezvous uses localhost.
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


class NetworkBlocked(RuntimeError):
    pass


def is_loopback(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def network_guard(monkeypatch):
    """Blocks non-loopback connections; yields the list of blocked attempts (a test that provokes one clears it)."""
    blocked: list[str] = []

    def check(host, what: str) -> None:
        if not is_loopback(host):
            blocked.append(f"{what} {host!r}")
            raise NetworkBlocked(f"tests must not use the network: {what} {host!r} was blocked (tests/conftest.py)")

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo, real_create_connection = socket.getaddrinfo, socket.create_connection

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            check(address[0], "connect to")
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            check(address[0], "connect to")
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None:
            check(host, "name lookup of")
        return real_getaddrinfo(host, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        check(address[0], "connect to")
        return real_create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    yield blocked
    assert not blocked, f"the test tried to use the network: {blocked}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def routing_kernel(monkeypatch):
    """The fused CPU dynamic-routing kernel, built explicitly (or loaded from the cache), with CAPSNET_NO_EXT unset
    for the test: the kernel tests' way in (a build failure fails the test)."""
    from capsnet.routing import dynamic_cpu

    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)
    return dynamic_cpu.build()


@pytest.fixture
def one_rank_ddp(monkeypatch):
    """A one-process gloo group that capsnet's training takes for a torchrun launch: the model is wrapped in
    DistributedDataParallel (which refuses, on the second step, a parameter without a gradient) and every
    collective runs, on one rank. The in-process check of what needs no second process; yields, for each DDP
    wrapper made, the wrapped module and a copy of its state at that moment (so a test sees that the path ran)."""
    import torch.distributed as dist

    from capsnet.training import distributed

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    monkeypatch.setattr(distributed.DistInfo, "enabled", property(lambda self: dist.is_initialized()))
    wrapped: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    real = torch.nn.parallel.DistributedDataParallel

    def wrap(module, *args, **kwargs):
        wrapped.append((module, {k: v.detach().clone() for k, v in module.state_dict().items()}))
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", wrap)
    yield wrapped
    if dist.is_initialized():  # (training's teardown destroys it at the end of a run)
        dist.destroy_process_group()
