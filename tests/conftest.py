import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The suite solves every calibration afresh (no entry of a user's cache, none left behind);
# tests/test_calibration_cache.py turns the cache on where it tests it.
os.environ.setdefault("FEDPERS_CALIBRATION_CACHE", "0")
