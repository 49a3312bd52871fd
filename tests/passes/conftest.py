import pytest


@pytest.fixture(scope="session")
def ort_library():
    from vlmprune.kernels import build

    try:
        return build.build_ort_library()
    except build.ToolNotFoundError as exc:
        pytest.skip(str(exc))
