"""The connector's conversion to the block store's canonical format (found by an operator trial: a cloud with
``dtype = "auto"`` runs its engines in bf16 on CPU, and saving a block crashed the tail engine on ``.numpy()``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.cloud.connector import canonical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_of_any_engine_dtype_are_stored_as_float32(dtype):
    block = torch.randn(2, 3, 32, 8).to(dtype)
    out = canonical(block)
    assert out.dtype == np.float32 and out.shape == (2, 3, 32, 8)
    np.testing.assert_array_equal(out, block.to(torch.float32).numpy())  # bf16/fp16 -> fp32 is exact
