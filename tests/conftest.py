"""Shared test setup: tiny models are latency-bound, so one intra-op thread is fastest and steadiest."""

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

from specdec import native  # noqa: E402

# The instruction-set levels of the C kernels this machine runs (an AVX-512 VNNI CPU runs all
# three), named by `SPECDEC_ISA`: kernel tests run at each, as a user holding the level would.
MACHINE_LEVELS = [level.name for level in native.machine_levels()]


@pytest.fixture(params=MACHINE_LEVELS or [pytest.param("none", marks=pytest.mark.skip(reason="no SIMD level runs here"))])
def simd_level(request, monkeypatch) -> str:
    """Each level this machine runs in turn, held with `SPECDEC_ISA` for the test's duration."""
    monkeypatch.setenv(native.ISA_ENV, request.param)
    monkeypatch.delenv("SPECDEC_NO_KERNELS", raising=False)
    return request.param


# Under `pytest -n 2 --dist loadgroup` (the README's command) each module runs whole on one worker,
# in its order, as it does serially (a module-scoped server then sees its requests in the order
# written); the modules that start a local Ray (and Ray Serve) share one group, so they run one
# after another on one worker, never two Rays at once.
RAY_MODULES = {"test_serve_replicas_cmd.py", "test_pd.py", "test_cluster.py", "test_ray_ranks.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = "ray" if item.path.name in RAY_MODULES else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
