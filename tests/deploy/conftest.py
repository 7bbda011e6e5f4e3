"""Session fixtures for the tests that build and run the real images (tests/deploy/images.py), and
`report`, the lines tests/conftest.py prints at the end of a run (build times, sizes)."""

from __future__ import annotations

import pytest

from . import images

REPORT_KEY = "image-report"  # tests/conftest.py prints these


@pytest.fixture(scope="session")
def image_unavailable() -> str | None:
    return images.unavailable_reason()


@pytest.fixture(scope="session")
def base_image(image_unavailable) -> images.Built:
    if image_unavailable:
        pytest.skip(f"real images cannot be built here: {image_unavailable}")
    with images.build_lock():
        return images.ensure_base()


@pytest.fixture(scope="session")
def gateway_image(base_image) -> images.Built:
    with images.build_lock():
        return images.build("runtime", images.GATEWAY_REPOSITORY, base_image.ref)


@pytest.fixture(scope="session")
def netinit_image(base_image) -> images.Built:
    with images.build_lock():
        return images.build("netinit", images.NETINIT_REPOSITORY, base_image.ref)


def report(record_property, line: str) -> None:
    """A line for the summary at the end of the run (works under xdist: reports carry it)."""
    record_property(REPORT_KEY, line)
