import os
import sys
import tempfile

import pytest

from automap.launch import preload

here = os.path.dirname(__file__)
# Helpers shared by the stage folders (models, forced plans, the serial side of
# parity tests) are imported by module name, also by spawned gloo workers
# (spawn passes sys.path on); pytest puts each test's own folder, where its
# workers live, on the path. Some tests check what the benches print (benches/
# holds their model builders), and the GPT-2 block of examples/ is the one the
# tests plan.
sys.path.insert(0, os.path.join(here, "support"))
sys.path.insert(1, os.path.join(here, "..", "benches"))
sys.path.insert(2, os.path.join(here, "..", "examples"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Gloo ranks fork from a server that has imported these once (automap.launch);
# most rank functions build a transformers or torchvision model.
preload("transformers", "transformers.models.gpt2.modeling_gpt2", "torchvision.models")
# Hypothesis keeps its files outside the repository (the property tests' child
# processes inherit this).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "automap-hypothesis"))


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups
def pytest_collection_modifyitems(config, items):
    """Every multi-process test sets its own pytest-timeout (a hang then fails in
    minutes with the test's name, instead of holding the whole suite), and all of
    them form one xdist group: under ``-n 2 --dist loadgroup`` they run one after
    another on one worker while the other worker takes the single-process tests
    (two gloo process groups at once would oversubscribe a 2-core machine)."""
    multiprocess = [item for item in items if item.get_closest_marker("multiprocess")]
    missing = [item.nodeid for item in multiprocess if item.get_closest_marker("timeout") is None]
    if missing:
        raise pytest.UsageError("multiprocess tests without @pytest.mark.timeout: "
                                + ", ".join(missing))
    for item in multiprocess:
        item.add_marker(pytest.mark.xdist_group("gloo"))
