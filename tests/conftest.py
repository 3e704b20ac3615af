import pytest
import torch

# One intra-op thread: the suite runs on 2 shared cores, where OpenMP spin-waiting on a busy second core makes
# small ops thousands of times slower. Both sides of every bitwise comparison run with the same setting.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
