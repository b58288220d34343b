"""The native kernels in tests: a test that needs them skips where they are not built, and FAILS under
``SPECDEC_REQUIRE_KERNELS=1`` (.ci/run sets it), so a broken build cannot pass CI as a row of skips; on an
architecture without rungs (aarch64 today: ``kernels.required()``) it skips even then."""
import pytest

from specdec import kernels


def require_native():
    """The loaded native library; else skip the calling test (fail it when the kernels are required)."""
    lib = kernels.library()
    if lib is None:
        msg = f"native kernels unavailable: {kernels.reason()}"
        if kernels.required():
            pytest.fail(f"{msg} (SPECDEC_REQUIRE_KERNELS=1: they must be built)", pytrace=False)
        pytest.skip(msg)
    return lib


def reference_and_native(cfg, quant: str | None = None):
    """The same random model of ``cfg`` twice, bf16 (seed 3): the PyTorch reference and the native twin
    (quantized alike when ``quant``); fails if the native forward refuses the model."""
    import torch  # noqa: PLC0415

    from specdec.models import native  # noqa: PLC0415
    from specdec.models.llama import build_model  # noqa: PLC0415
    from specdec.quant.qlinear import quantize_model  # noqa: PLC0415

    ref, nat = (build_model(cfg, dtype=torch.bfloat16, seed=3) for _ in range(2))
    if quant:
        quantize_model(ref, quant)
        quantize_model(nat, quant)
    assert nat.make_native(), native.unsupported(nat)
    return ref, nat
