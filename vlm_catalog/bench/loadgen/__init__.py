"""The MLPerf LoadGen harness behind `vlm-catalog bench` (see harness.py for one run)."""
