import os

# CuTe DSL fixes its target arch when cutlass is first imported, which collection may do from
# any module (tests/gpu/ imports kernels at module level): the compile tests target Hopper.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    # tests/gpu/ needs CUDA: skip it cleanly (with the reason) where there is none.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the H200 via the device tool)")
    for item in items:
        if "gpu" in item.keywords or f"{os.sep}gpu{os.sep}" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for one test module (started here only if none is running)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
