"""The native kernels in tests: a test that needs them skips where they are not built, and FAILS under
``SPECDEC_REQUIRE_KERNELS=1`` (.ci/run sets it), so a broken build cannot pass CI as a row of skips."""
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
