"""Fixtures of the stages' tests."""
import pytest

from layerwise.stages.disk.reader import filesystem_type


@pytest.fixture
def disk_dir(tmp_path):
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on a memory file system here")  # CI's /tmp is ext4 (checked in test_reader.py)
    return tmp_path
