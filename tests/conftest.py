import os
import sys

here = os.path.dirname(__file__)
# Spawned gloo workers import helpers from this folder by module name; some
# tests check what the benches print (benches/ holds their model builders),
# and the GPT-2 block of examples/ is the one the tests plan.
sys.path.insert(0, here)
sys.path.insert(1, os.path.join(here, "..", "benches"))
sys.path.insert(2, os.path.join(here, "..", "examples"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
