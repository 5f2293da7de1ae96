import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import kernels  # noqa: F401  (switches Triton to its interpreter when there is no GPU)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter computes tl.dot on bf16 wrongly: bf16 is checked on the GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

# print_blob: a failure prints the @reproduce_failure line that replays its draw (CI runs
# fresh clones, so Hypothesis's example database never holds it).
settings.register_profile(
    "cpu", max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.register_profile(
    "gpu", max_examples=100, deadline=None, suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if ON_GPU else "cpu"))


def kernel_examples(gpu: int, cpu: int) -> int:
    """Hypothesis examples of a kernel test module. ``MULTILORA_TEST_EXAMPLES`` overrides both:
    on a GPU each drawn shape compiles its own Triton variants, so a quick pass there wants
    few (the default count ran past a 200-second limit on the H200)."""
    return int(os.environ.get("MULTILORA_TEST_EXAMPLES", gpu if ON_GPU else cpu))


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
