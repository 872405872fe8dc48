"""The compiled JSON-lines writer (exporter/_jsonl.c), built by `pip install`
(scripts/setup.sh) next to the pure-Python reference in exporter/records.py.
Optional: without a C compiler and Python's headers the install still
succeeds and nettap uses the reference writer (and logs so)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("exporter._jsonl", ["exporter/_jsonl.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
