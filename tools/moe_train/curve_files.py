"""Opening a run's per-step curve file, text or gzipped, without torch (for light tools such
as ``tools/loss_windows.py``)."""

import gzip
from pathlib import Path


def open_metrics(path):
    """``path`` (a ``metrics_<recipe>.csv``) opened for reading, or its gzipped twin
    ``<path>.gz`` where only that exists: committed runs keep their per-step curves gzipped
    (a 3000-step curve is 370 kB as text, 140 kB gzipped; the repository travels to the GPU
    machine under a size limit)."""
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        return gzip.open(path.with_name(path.name + ".gz"), "rt", newline="")
    return open(path, newline="")
