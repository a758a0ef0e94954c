"""scripts/bench_ab.py: the before/after table of one suite, from two checkouts."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_same_checkout_twice_gives_a_row_per_measure_with_its_ratio():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ab.py"), str(ROOT), str(ROOT),
                           "--suite", "hooks", "--rounds", "1", "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 4, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        float(cells[1]), float(cells[2])
        assert cells[3] == "n/a" or float(cells[3]) >= 0, row
    headline = [r for r in rows if r.startswith("| pre+post hook time per layer")]
    assert headline and all(float(r.strip("|").split("|")[3]) > 0 for r in headline), proc.stdout
