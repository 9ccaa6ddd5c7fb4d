"""One place per extension point: a backend, a figure and a claim are each declared once, and
everything that lists them is derived from that declaration or held to it here."""
import re
from pathlib import Path

import yaml

from bppsa import doctor
from bppsa.backends import BACKENDS, CUPY_BACKENDS
from bppsa.backends.cuda import cost_model

ROOT = Path(__file__).resolve().parents[1]


# -- backends ------------------------------------------------------------------------------------------
def test_backends_is_the_one_list():
    """The config schema's enum, doctor's checks, the cost model and config/README.md name exactly BACKENDS."""
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert schema["properties"]["backend"]["enum"] == list(BACKENDS)
    assert set(doctor.CHECKED) == set(BACKENDS) - {"auto"}
    # every backend that is neither the reference twin nor the CPU path runs on the GPU: the cost model must
    # know which layout each runs, and no more
    gpu = set(BACKENDS) - {"auto", "torch", "cpu"}
    assert set(CUPY_BACKENDS) == gpu
    assert {backend for _, backend in cost_model.LAYOUT_OF} == gpu
    assert set(cost_model.LAYOUT_OF.values()) == set(cost_model.LAYOUTS)
    readme = (ROOT / "config" / "README.md").read_text()
    (cell,) = re.findall(r"`backend` \(([^)]*)\)", readme)
    assert re.findall(r"`([\w-]+)`", cell) == list(BACKENDS)
