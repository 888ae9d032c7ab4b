import os
import sys
import tempfile
from pathlib import Path

import pytest

from automap.launch import preload

here = os.path.dirname(__file__)
# Helpers shared by the stage folders (models, forced plans, the serial side of
# parity tests) are imported by module name, also by spawned gloo workers
# (a rank gets the caller's sys.path); pytest puts each test's own folder, where its
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


def _marked(config):
    from gloo_together import multiprocess_tests

    if not hasattr(config, "_automap_multiprocess"):
        config._automap_multiprocess = multiprocess_tests(config.rootpath, Path(here))
    return config._automap_multiprocess


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n 2`` the multiprocess tests run one after another on one
    worker while the other worker takes the single-process tests
    (``gloo_together``)."""
    from gloo_together import GlooTestsTogether

    return GlooTestsTogether(config, log, _marked(config))


def pytest_collection_modifyitems(config, items):
    """Every multi-process test sets its own pytest-timeout (a hang then fails in
    minutes with the test's name, instead of holding the whole suite), and is
    marked in a form the xdist scheduler reads from the sources."""
    from gloo_together import check_collected

    missing = [item.nodeid for item in items
               if item.get_closest_marker("multiprocess") is not None
               and item.get_closest_marker("timeout") is None]
    if missing:
        raise pytest.UsageError("multiprocess tests without @pytest.mark.timeout: "
                                + ", ".join(missing))
    unread = check_collected(items, _marked(config))
    if unread:
        raise pytest.UsageError("mark multiprocess tests with a module-level pytestmark or "
                                "@pytest.mark.multiprocess on the test function: "
                                + ", ".join(unread))
