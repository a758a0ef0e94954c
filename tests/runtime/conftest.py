import pytest

from layerwise.runtime import cohort


@pytest.fixture
def patient(monkeypatch):
    """A call is never given up on for being slow between two layers, nor aged
    early, nor checked for life: on a loaded machine a thread may pause longer than
    Cohort.STALL_S, and a byte bound would then count the refetch that costs
    (bytes only: exactness never depends on it)."""
    monkeypatch.setattr(cohort.Cohort, "STALL_S", 600.0)
    monkeypatch.setattr(cohort.Cohort, "AGE_S", 600.0)
    monkeypatch.setattr(cohort.Cohort, "CHECK_S", 600.0)
