# A package, so that the test modules can import the shared helpers from
# .conftest (pytest imports this conftest as `gpu.conftest`).
