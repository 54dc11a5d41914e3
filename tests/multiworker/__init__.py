"""The multi-worker tests: run in every rank of an MPI job (see conftest.py)."""
