"""A rank that only waits (it is stopped when the job ends): for start-up tests."""

import time

time.sleep(600)
