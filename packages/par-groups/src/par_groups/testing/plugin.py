"""pytest plugin (registered by par-groups' entry point): the ``dist_run`` fixture.

    def check(x):                       # module level, runs on every rank
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_ranks(dist_run):
        assert dist_run(4, check, 10) == [0, 10, 20, 30]

``dist_run(world_size, fn, *args, timeout=None, **kwargs)`` returns each rank's result;
workers are started once per world size and shared by the whole test session.
"""

import gc

import pytest

from .harness import Harness


def pytest_addoption(parser):
    parser.addini("par_preload", "modules the rank workers' forkserver imports once (the suite's own packages)",
                  type="linelist", default=[])


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: CUDA checks against the CPU fp32 result (tools/gpu/check.sh runs them); "
                                       "skipped without a GPU")


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, our packages) lives as long as the session:
    # frozen, the cyclic collector stops walking its ~10^6 objects at every full collection.
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()  # let interpreter shutdown free it as usual


@pytest.fixture(scope="session")
def dist_run(pytestconfig):
    harness = Harness(tuple(pytestconfig.getini("par_preload")))
    yield harness
    harness.close()
